"""``live_elements`` is what is resident: the elements of exactly the parameters whose storage
holds bytes, at every module boundary of forward and backward."""

from __future__ import annotations

from coord_cases import ReduceScatterSink, TiedBranchModel, build, coordinate, over_worlds, rank_input

import zero_params
from zero_coord import CoordinatorConfig

TIGHT = CoordinatorConfig(prefetch_bucket_size=40, max_live_parameters=120, max_reuse_distance=0)


def _resident_numel(model) -> int:
    total = 0
    for p in model.parameters():
        state = zero_params.state_of(p)
        if not state.persistent and state.unsharded.nbytes:
            total += state.numel
    return total


class _Sampler(ReduceScatterSink):
    """A sink that also compares the coordinator's count with the resident storages."""

    def __init__(self, model) -> None:
        super().__init__()
        self.model = model
        self.coord = None
        self.samples: list[tuple[str, int, int]] = []

    def sample(self, where: str) -> None:
        self.samples.append((where, self.coord.live_elements, _resident_numel(self.model)))

    def on_grad_ready(self, param) -> None:
        self.sample(f"grad {zero_params.state_of(param).name}")
        super().on_grad_ready(param)


def _live_matches_resident(rank):
    model, _ = build(TiedBranchModel)
    sink = _Sampler(model)
    sink.coord = coordinate(model, TIGHT, sink)
    for name, module in model.named_modules():
        module.register_forward_hook(lambda m, a, o, name=name: sink.sample(f"forward {name}"))
    for step, go_left in enumerate([True, True, False, True]):
        out = model(rank_input(step, rank.rank, (3, 4), high=11), go_left)
        sink.sample("after forward")
        out.pow(2).mean().backward()
        sink.sample("after backward")
    sink.coord.remove()
    return sink.samples


@over_worlds
def test_live_elements_count_exactly_the_resident_parameters(dist, world):
    for samples in dist.run(world, _live_matches_resident):
        wrong = [s for s in samples if s[1] != s[2]]
        assert not wrong, wrong[:5]
        assert any(live for _, live, _ in samples) and samples[-1][1:] == (0, 0)
