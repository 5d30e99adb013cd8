"""``oracle``: a proposer that knows each prompt's reference continuation (a JSON file named by
``speculative.options.reference``: prompt token ids joined by commas -> output token ids) and drafts it,
with one draft made wrong every ``speculative.options.corrupt_every`` proposals, so that the engine's
verification sees long accepted runs, rejections at every position, and bonus tokens."""

import json

import engine
from engine.interfaces.proposer import Proposer

ENGINE_CONTRACT_VERSION = "1.6"


class OracleProposer(Proposer):
    name = "oracle"
    priority = 0

    def __init__(self, vllm_config):
        super().__init__(vllm_config)
        options = vllm_config.speculative.options
        with open(options["reference"]) as f:
            self.reference = json.load(f)
        self.corrupt_every = int(options.get("corrupt_every", 3))
        self.num_proposals = 0
        self.finished_ids = []

    def propose(self, batch):
        drafts = []
        for i in range(len(batch)):
            tokens = batch.token_ids(i).tolist()
            num_prompt = int(batch.num_prompt_tokens[i])
            reference = self.reference.get(",".join(map(str, tokens[:num_prompt])))
            output = tokens[num_prompt:]
            if reference is None or reference[: len(output)] != output:
                drafts.append([])
                continue
            guess = reference[len(output) : len(output) + int(batch.max_num_drafts[i])]
            self.num_proposals += 1
            if guess and self.num_proposals % self.corrupt_every == 0:
                wrong = self.num_proposals // self.corrupt_every % len(guess)
                guess[wrong] = (guess[wrong] + 1) % 1000 + 100
            drafts.append(guess)
        return drafts

    def finished(self, req_ids):
        self.finished_ids.extend(req_ids)


@engine.hookimpl
def engine_spec_proposers():
    return [OracleProposer]
