"""The version of the plugin's numerics: what the bytes it computes depend on in its code.

GlmCacheConnector names every cached object by everything its bytes depend on (the
namespace, ``connector.namespace.engine_fingerprint``). vLLM's version names vLLM's code; the
checkpoint's content names the weights; the cache-row format
(``mla_layer.CACHE_ROW_FORMAT``) names what the rows mean. None of those changes when this
package changes *how* it computes: a reordered reduction, a kernel swapped for another, a
fixed rounding, a different top-k tie-break. Two releases of the plugin that compute other
KV for the same tokens must not share objects during a rolling upgrade, so the connector
joins :data:`NUMERICS_VERSION` into the namespace of every engine whose model class is this
package's (``connector.namespace.model_numerics_version``: it reads ``NUMERICS_VERSION`` from the
top-level package of the class vLLM resolves; vLLM's own GLM5-Next implementation, the
``native`` choice, has none and is named by vLLM's version).

Bump it with any change that moves the plugin's outputs (the KV rows, the KDA states, the
logits), and re-record ``tests/engine/test_identity_runtime.py``'s reference values for the new
number: that test runs a float32 forward of the tiny checkpoint and fails, asking for
the bump, when the outputs move under an unchanged version. A change that leaves every
output bit-for-bit alone (a refactor, a new feature behind a flag that is off) keeps it.
"""

NUMERICS_VERSION = 1
