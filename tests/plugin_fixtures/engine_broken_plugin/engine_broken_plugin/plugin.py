"""A sampler that ignores temperature and a logits processor that touches every row: the conformance kit
(engine.testing.conformance) must fail both."""

from engine import hookimpl
from engine.interfaces.logits_processor import LogitsProcessor
from engine.interfaces.sampler import Sampler, SamplerOutput

ENGINE_CONTRACT_VERSION = "1.3"


class ArgmaxOnly(Sampler):
    name = "argmax_only"
    priority = -1

    def __call__(self, logits, metadata):
        return SamplerOutput(logits.argmax(dim=-1))


class EveryRow(LogitsProcessor):
    name = "every_row"
    priority = -100

    @classmethod
    def requested_by(cls, params):
        return bool(params.extra_args) and "every_row" in params.extra_args

    def apply(self, logits, batch):
        logits -= 1.0  # every row, not only batch.rows


@hookimpl
def engine_samplers():
    return [ArgmaxOnly]


@hookimpl
def engine_logits_processors():
    return [EveryRow]
