"""The "collectives" torch.distributed backend around the collectives: init methods, explicit
stores and direct construction, subgroups, options, async Works and futures, refusals, failures
(a mismatch, a killed rank) and DistributedDataParallel. Every test runs real processes."""

import os

import pytest

import torch_workers as w


@pytest.mark.parametrize("how", ["env", "tcp", "file", "tcp_store", "file_store"])
def test_init_methods(how, tmp_path):
    where = w.free_port() if how.startswith("tcp") else str(tmp_path / "store")
    assert w.launch(w.init_method, 2, how, where) == [True, True]


def test_direct_construction(tmp_path):
    assert w.launch(w.direct_construction, 2, str(tmp_path / "store")) == [[True, "ring", 4096]] * 2


def test_subgroups():
    results = w.launch(w.subgroups, 4)
    for rank, got in enumerate(results):
        assert all(v for k, v in got.items() if not k.endswith("impl")), (rank, got)
    assert results[0]["low_impl"] == "auto"
    assert results[2]["high_impl"] == "ring"


def test_options_and_environment():
    got = w.launch(w.options, 2, env={"COLLECTIVES_IMPLEMENTATION": "ring",
                                      "COLLECTIVES_TORCH_INLINE_BYTES": "64"})
    assert got == [["ring", 8192, True, "auto", 16384, 64]] * 2


def test_async_work_and_futures():
    for rank, ok in enumerate(w.launch(w.async_work, 2)):
        assert all(ok), (rank, ok)


def test_bad_arguments_are_refused_by_name():
    for rank, seen in enumerate(w.launch(w.bad_arguments, 2)):
        for key, result in seen.items():
            assert result is True or (isinstance(result, str) and not result.startswith(
                ("did not raise", "wrong message"))), (rank, key, result)


def test_mismatch_raises_on_every_rank():
    for rank, (message, elapsed, untouched, later) in enumerate(w.launch(w.mismatch, 2)):
        assert "match" in message and "all_reduce" in message.lower(), (rank, message)
        assert untouched, rank
        assert elapsed < 20, (rank, elapsed)
        assert later != "did not raise", rank


def test_killed_rank_every_survivor_raises():
    results = w.launch(w.killed_rank, 3, allow_exit=(2,), timeout=60)
    for rank, (message, future, elapsed) in enumerate(results[:2]):
        assert message != "did not raise", rank
        assert future != "did not raise", rank
        assert elapsed < 12, (rank, elapsed, message)


def test_ddp_matches_gloo_and_single_process_training():
    import torch
    for ours, gloo, reference in w.launch(w.ddp_versus_gloo, 2, w.free_port()):
        assert ours == gloo  # bit for bit: two ranks add in either order to the same sum
        for g, ref in zip(ours, reference):
            assert torch.allclose(torch.tensor(g), torch.tensor(ref), atol=1e-5), (g, ref)


def test_inline_small_calls():
    # all_reduce, broadcast and barrier on the caller's thread (Options.inline_bytes), async
    # forms and futures included, amid asynchronous calls of larger sizes.
    failures = sum(w.launch(w.matrix, 2, [0, 13, 65537], ["float32", "int8"],
                            env={"COLLECTIVES_TORCH_INLINE_BYTES": "65536"}), [])
    assert not failures, "\n".join(failures[:40])
