"""dsa-lite (spin_trtllm.harness) test helpers: prompts, a drafter for MTP, a cost model that
follows a plan, and a schedule of arriving requests run to completion."""

from spin_trtllm import SpinConfig
from spin_trtllm.costs import CostModel
from spin_trtllm.harness import Request

TEXT = ("def fib(n):\n    return n if n < 2 else fib(n - 1) + fib(n - 2)\n" * 40).encode()
ARRIVAL_TEXT = bytes(range(32, 127)) * 40


def spin_cfg(**kw):
    base = dict(index_topk=64, target_sparsity=0.5, exploration=0.2)
    base.update(kw)
    return SpinConfig(**base)


def prompt(n, offset=0):
    return TEXT[offset:offset + n]


def copy_drafter(rid, context, depth):
    """Drafts the tokens that followed the last token's previous occurrence: often right on
    repetitive output, so MTP rows beyond row 0 get accepted."""
    last = context[-1]
    for i in range(len(context) - 2, -1, -1):
        if context[i] == last:
            nxt = context[i + 1:i + 1 + depth]
            return nxt + [0] * (depth - len(nxt))
    return [0] * depth


class Scheduled(CostModel):
    """A cost model whose decisions follow a list (one per decode step)."""

    def __init__(self, plan):
        super().__init__()
        object.__setattr__(self, "plan", list(plan))

    def prefer_spin(self, *args, **kwargs):
        return self.plan.pop(0) if self.plan else True


def schedule_run(engine, arrivals):
    """arrivals: {engine step: [Request, ...]} submitted before that step; runs until every
    request finished. Returns {request_id: output}."""
    outs, t = {}, 0
    while t <= max(arrivals) or not engine.idle:
        for r in arrivals.get(t, []):
            engine.submit(r)
        outs.update({o.request_id: o for o in engine.step()})
        t += 1
    return outs


# (decode share, prompt share) of arrivals() for runs under a sanitizer (tests/test_harness_gpu.py
# says why these): short for memcheck and synccheck, brief for initcheck and racecheck
SHORT_SCHEDULE = (0.5, 1.0)
BRIEF_SCHEDULE = (0.25, 0.2)


def arrivals(decode_share: float = 1.0, prompt_share: float = 1.0):
    """Four requests arriving at steps 0, 0, 3 (with a second turn) and 6, greedy and sampled.
    decode_share scales their new tokens (at least 3 each) and prompt_share their first turns'
    prompts: the same schedule with fewer decode steps and shorter prefills, for runs under a
    sanitizer."""
    def new(n: int) -> int:
        return max(3, round(n * decode_share))

    def prompt(start: int, end: int) -> str:
        return ARRIVAL_TEXT[start:start + max(1, round((end - start) * prompt_share))]

    return {0: [Request(prompt(0, 1500), max_new_tokens=new(24), request_id=0),
                Request(prompt(7, 900), max_new_tokens=new(10), temperature=0.8, seed=2,
                        request_id=1)],
            3: [Request(prompt(3, 1200), max_new_tokens=new(16), request_id=2,
                        turns=[ARRIVAL_TEXT[50:150]])],
            6: [Request(prompt(9, 400), max_new_tokens=new(12), request_id=3)]}
