"""Every torch.distributed collective of the "collectives" backend, on every supported dtype and
on sizes 0, 1, a prime and a large prime, in real processes of world sizes 1 to 4: results are
checked on every rank against references computed with plain torch from the known inputs."""

import pytest

from torch_workers import launch, matrix

SIZES = [0, 1, 13, 65537]


@pytest.mark.parametrize("world", [1, 2, 3, 4])
def test_every_collective_every_dtype(world):
    failures = sum(launch(matrix, world, SIZES, timeout=120), [])
    assert not failures, "\n".join(failures[:40])
