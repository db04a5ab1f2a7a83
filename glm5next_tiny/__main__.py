"""``python -m glm5next_tiny OUT_DIR ...``: the ``glm5next-tiny`` command."""

from .cli import main

main()
