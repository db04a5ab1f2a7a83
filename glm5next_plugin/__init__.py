"""vLLM out-of-tree model plugin for GLM-5.3-Flash (``Glm5NextForConditionalGeneration``)."""


def register() -> None:
    """Entry point of the ``vllm.general_plugins`` group.

    vLLM calls it once in every process it starts, so it must be idempotent.
    """
