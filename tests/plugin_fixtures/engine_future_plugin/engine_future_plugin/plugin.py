from engine import hookimpl
from engine.attention.torch_backend import TorchAttentionBackend

ENGINE_CONTRACT_VERSION = "2.0"


class FutureBackend(TorchAttentionBackend):
    name = "future_attention"


@hookimpl
def engine_attention_backends():
    return [FutureBackend]
