"""A logits processor with a bug that only some requests trigger: ``extra_args={"fail": true}``.

It stands for any per-request failure inside the engine core (a third-party processor, a sampler, a
kernel that rejects one request's shape): the engine must end that request alone and serve the others.
"""

from engine import hookimpl
from engine.interfaces.logits_processor import LogitsProcessor

ENGINE_CONTRACT_VERSION = "1.3"


class FaultyProcessor(LogitsProcessor):
    name = "faulty"

    @classmethod
    def requested_by(cls, params) -> bool:
        return bool(params.extra_args and "fail" in params.extra_args)

    def apply(self, logits, batch):
        for params in batch.params:
            if params.extra_args["fail"]:
                raise RuntimeError("faulty processor: this request asked to fail")


@hookimpl
def engine_logits_processors():
    return [FaultyProcessor]
