#!/usr/bin/python3
"""PyTorch DistributedDataParallel on Fashion-MNIST over a torch.distributed backend.

The model and recipe of the C++ training demo (examples/train): an MLP 784-256-256-10 with ReLU
and logits, Glorot-uniform kernels and zero biases, sparse categorical cross-entropy from
logits, Adam with learning rate 1e-3, inputs scaled to [0, 1], global batch 256, the training
set shuffled every epoch with a permutation from (seed, epoch), the last partial batch kept.

Run N processes on this host (the script starts them, with the environment torchrun sets):

  PYTHONPATH=build/python /usr/bin/python3 examples/python/ddp_fashion_mnist.py --nproc 2 \\
      --backend collectives --epochs 1

or start one process per rank with a launcher that sets RANK, WORLD_SIZE, MASTER_ADDR and
MASTER_PORT:

  PYTHONPATH=build/python /usr/bin/python3 -m torch.distributed.run --nproc_per_node 2 \\
      --redirects 1 --tee 1 examples/python/ddp_fashion_mnist.py --backend collectives

(Debian's torch 1.13 under Python 3.11 cannot parse torch.distributed.run's own default
--redirects 0 and --tee 0; any other value works.)

Sharding: every rank computes the same order; rank r of N takes elements [r*B/N, (r+1)*B/N) of
each global batch of B (a last partial batch fills the ranks in order with up to B/N each, so
the last ranks may get fewer or none). Each rank's loss is the sum of its per-example losses
times N / (examples in the global batch); DDP averages the gradients over the N ranks, so the
update is that of the global batch's mean loss: the same arithmetic as one process training on
the whole global batch, up to the order of float sums. --check-single verifies exactly that,
for short runs: with the default recipe the two agree within 1e-5 for about 150 steps, after
which rounding differences flip ReLU units and Adam amplifies them (one process summing two
half-batches drifts from one summing the whole batch in the same way); larger shards drift
sooner (global batch 8192 over 4 ranks: 3.5e-5 after 7 steps).

Printed by rank 0: per epoch the training loss and accuracy over every rank; the test accuracy
(10000 examples); samples per second over the steady-state steps (the first --warmup-steps
excluded); whether the weights are bit-identical on every rank (compared with rank 0's over a
separate Gloo group, so a faulty backend cannot vouch for itself).

Exit status: 0 on success; 1 when the weights differ between ranks or --check-single fails;
2 on a bad command line or missing data.
"""

import argparse
import contextlib
import datetime
import gzip
import hashlib
import json
import os
import sys
import time


import numpy as np
import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn
from torch.nn.parallel import DistributedDataParallel

DEFAULT_DATA_DIR = "/usr/share/datasets/fashion-mnist"


def parse_args(argv):
    p = argparse.ArgumentParser(
        description="PyTorch DDP on Fashion-MNIST (the C++ demo's model and recipe): --nproc N "
        "starts N processes on this host, or a launcher (torchrun) starts one per rank",
        formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    p.add_argument("--nproc", type=int, default=1,
                   help="processes to start on this host when no launcher set RANK")
    p.add_argument("--backend", default="collectives", choices=["collectives", "gloo"],
                   help="torch.distributed backend that synchronises the gradients")
    p.add_argument("--epochs", type=int, default=1, help="epochs to train")
    p.add_argument("--steps", type=int, default=0,
                   help="train this many steps in all (a short run; 0: --epochs full epochs)")
    p.add_argument("--global-batch", type=int, default=256,
                   help="examples per step over all ranks; a multiple of the world size")
    p.add_argument("--learning-rate", type=float, default=1e-3, help="Adam's learning rate")
    p.add_argument("--seed", type=int, default=42, help="initialisation and shuffle seed")
    p.add_argument("--no-sync", action="store_true",
                   help="skip gradient synchronisation (DDP's no_sync()): the speed bound; "
                   "the ranks' weights then differ")
    p.add_argument("--check-single", action="store_true",
                   help="after training, rank 0 trains one process on the same global batches "
                   "and requires the weights to agree within --tolerance (short runs: float "
                   "rounding differences grow past 1e-5 after about 150 steps)")
    p.add_argument("--tolerance", type=float, default=1e-5,
                   help="--check-single: largest allowed |difference| of any weight")
    p.add_argument("--warmup-steps", type=int, default=10,
                   help="first steps left out of samples/s")
    p.add_argument("--data-dir", default=DEFAULT_DATA_DIR,
                   help="the gzipped IDX files (Debian's dataset-fashion-mnist)")
    p.add_argument("--timeout", type=float, default=300,
                   help="seconds a collective waits for its peers")
    p.add_argument("--json", metavar="FILE", help="rank 0 writes the results here as JSON")
    args = p.parse_args(argv)
    if args.epochs < 1:
        p.error(f"--epochs {args.epochs}: must be at least 1")
    if args.steps < 0:
        p.error(f"--steps {args.steps}: must be at least 0")
    if args.global_batch < 1:
        p.error(f"--global-batch {args.global_batch}: must be at least 1")
    if args.warmup_steps < 0:
        p.error(f"--warmup-steps {args.warmup_steps}: must be at least 0")
    if args.nproc < 1:
        p.error(f"--nproc {args.nproc}: must be at least 1")
    if args.no_sync and args.check_single:
        p.error("--check-single needs synchronised gradients; drop --no-sync")
    return args


def read_idx(path, expected_magic):
    """An IDX file (gzipped or plain) as a numpy uint8 array of the dimensions in its header."""
    opener = gzip.open if path.endswith(".gz") else open
    with opener(path, "rb") as f:
        data = f.read()
    if len(data) < 4:
        raise ValueError(f"{path}: truncated IDX header ({len(data)} bytes)")
    magic = int.from_bytes(data[0:4], "big")
    if magic != expected_magic:
        raise ValueError(f"{path}: IDX magic {magic:#x}, expected {expected_magic:#x}")
    ndim = magic & 0xFF
    header = 4 + 4 * ndim
    if len(data) < header:
        raise ValueError(f"{path}: truncated IDX header ({len(data)} bytes)")
    dims = [int.from_bytes(data[4 + 4 * i:8 + 4 * i], "big") for i in range(ndim)]
    expected = header + int(np.prod(dims))
    if len(data) != expected:
        raise ValueError(f"{path}: {len(data)} bytes, expected {expected} for dimensions {dims}")
    return np.frombuffer(data, dtype=np.uint8, offset=header).reshape(dims)


def load_split(data_dir, split):
    """(images as float32 [n, 784] in [0, 1], labels as int64 [n]) of 'train' or 't10k'."""
    images = read_idx(os.path.join(data_dir, f"{split}-images-idx3-ubyte.gz"), 0x803)
    labels = read_idx(os.path.join(data_dir, f"{split}-labels-idx1-ubyte.gz"), 0x801)
    if images.shape[0] != labels.shape[0]:
        raise ValueError(f"{data_dir}: {split}: {images.shape[0]} images but "
                         f"{labels.shape[0]} labels")
    if labels.size and labels.max() > 9:
        raise ValueError(f"{data_dir}: {split}: label {labels.max()} out of range 0..9")
    x = torch.from_numpy(images.reshape(images.shape[0], -1).astype(np.float32) / 255.0)
    y = torch.from_numpy(labels.astype(np.int64))
    return x, y


def make_model(seed):
    """The MLP 784-256-256-10; Glorot-uniform kernels from the seed, zero biases."""
    model = nn.Sequential(nn.Linear(784, 256), nn.ReLU(), nn.Linear(256, 256), nn.ReLU(),
                          nn.Linear(256, 10))
    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for layer in model:
            if isinstance(layer, nn.Linear):
                fan_out, fan_in = layer.weight.shape
                limit = (6.0 / (fan_in + fan_out)) ** 0.5
                layer.weight.uniform_(-limit, limit, generator=generator)
                layer.bias.zero_()
    return model


def epoch_order(num_examples, seed, epoch):
    """The permutation of epoch `epoch`: a function of (seed, epoch) only, equal on every rank."""
    return torch.from_numpy(np.random.default_rng([seed, epoch]).permutation(num_examples))


def global_batch(order, step, batch):
    return order[step * batch:(step + 1) * batch]


def rank_shard(batch_indices, rank, world_size, batch):
    per_rank = batch // world_size
    return batch_indices[rank * per_rank:(rank + 1) * per_rank]


def flat_weights(model):
    return torch.cat([p.detach().reshape(-1) for p in model.parameters()])


def accuracy(model, x, y):
    with torch.no_grad():
        return (model(x).argmax(dim=1) == y).sum().item() / max(1, y.numel())


def train_single(args, x, y, total_steps, steps_per_epoch):
    """One process on the whole global batch of every step: the reference for --check-single."""
    model = make_model(args.seed)
    optimizer = torch.optim.Adam(model.parameters(), lr=args.learning_rate)
    order, order_epoch = None, -1
    for g in range(total_steps):
        epoch, step = divmod(g, steps_per_epoch)
        if epoch != order_epoch:
            order, order_epoch = epoch_order(x.shape[0], args.seed, epoch), epoch
        idx = global_batch(order, step, args.global_batch)
        loss = F.cross_entropy(model(x[idx]), y[idx], reduction="sum") / idx.numel()
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        optimizer.step()
    return model


def launch(nproc, argv):
    """Runs this script as ranks 0..nproc-1 on this host (collectives.launch.run_local)."""
    from collectives.launch import run_local
    return run_local(nproc, [os.path.abspath(__file__)] + argv, name="ddp_fashion_mnist")


def say(rank, *parts):
    if rank == 0:
        print(*parts, flush=True)


def main(argv):
    args = parse_args(argv)
    if "RANK" not in os.environ:
        return launch(args.nproc, argv)
    if args.backend == "collectives":
        try:
            import collectives.torch  # noqa: F401  (registers the backend "collectives")
        except ImportError as e:
            print(f"ddp_fashion_mnist: --backend collectives: cannot import collectives.torch "
                  f"({e}); build the torch backend and set PYTHONPATH=build/python",
                  file=sys.stderr)
            return 2

    try:
        x_train, y_train = load_split(args.data_dir, "train")
        x_test, y_test = load_split(args.data_dir, "t10k")
    except (OSError, ValueError) as e:
        print(f"ddp_fashion_mnist: data: {e} (Debian package dataset-fashion-mnist)",
              file=sys.stderr)
        return 2

    timeout = datetime.timedelta(seconds=args.timeout)
    dist.init_process_group(args.backend, timeout=timeout)
    rank, world_size = dist.get_rank(), dist.get_world_size()
    # Checks travel over Gloo, apart from the backend under test.
    check_group = dist.new_group(backend="gloo", timeout=timeout)

    batch = args.global_batch
    if batch % world_size != 0 or batch > x_train.shape[0]:
        say(rank, f"ddp_fashion_mnist: --global-batch {batch} must be a multiple of the "
            f"{world_size} ranks and at most the {x_train.shape[0]} training examples")
        dist.destroy_process_group()
        return 2
    steps_per_epoch = -(-x_train.shape[0] // batch)
    total_steps = args.steps if args.steps > 0 else args.epochs * steps_per_epoch
    warmup = min(args.warmup_steps, max(0, total_steps - 1))

    model = make_model(args.seed)
    # Broadcasts rank 0's weights. The gradients live in DDP's buckets (the memory the backend
    # reduces), not in copies of them: one copy of every gradient less per step, on every
    # backend, with or without --no-sync.
    ddp = DistributedDataParallel(model, gradient_as_bucket_view=True)
    optimizer = torch.optim.Adam(ddp.parameters(), lr=args.learning_rate)
    say(rank, f"ddp_fashion_mnist: backend {args.backend}, {world_size} processes, "
        f"{torch.get_num_threads()} thread(s) each; MLP 784-256-256-10, "
        f"{sum(p.numel() for p in model.parameters())} parameters; Adam, learning rate "
        f"{args.learning_rate:g}; global batch {batch} ({batch // world_size} per rank), "
        f"{steps_per_epoch} steps per epoch, {total_steps} steps"
        f"{'; gradients NOT synchronised (--no-sync)' if args.no_sync else ''}")

    results = {"backend": args.backend, "world_size": world_size, "global_batch": batch,
               "steps": total_steps, "no_sync": args.no_sync, "epochs": []}
    order, order_epoch = None, -1
    totals = torch.zeros(3)  # loss sum, correct, examples over this rank's shards
    timed_samples, timed_start = 0, None
    for g in range(total_steps):
        if g == warmup:
            timed_start = time.perf_counter()
        epoch, step = divmod(g, steps_per_epoch)
        if epoch != order_epoch:
            order, order_epoch = epoch_order(x_train.shape[0], args.seed, epoch), epoch
        batch_indices = global_batch(order, step, batch)
        idx = rank_shard(batch_indices, rank, world_size, batch)
        optimizer.zero_grad(set_to_none=True)
        # no_sync() must cover the forward pass too: DDP's forward prepares the reduction.
        with ddp.no_sync() if args.no_sync else contextlib.nullcontext():
            logits = ddp(x_train[idx])
            losses = F.cross_entropy(logits, y_train[idx], reduction="none")
            loss = losses.sum() * (world_size / batch_indices.numel())
            loss.backward()
        optimizer.step()
        if g >= warmup:
            timed_samples += batch_indices.numel()
        with torch.no_grad():
            totals += torch.tensor([losses.sum().item(),
                                    (logits.argmax(dim=1) == y_train[idx]).sum().item(),
                                    idx.numel()])
        if step == steps_per_epoch - 1 or g == total_steps - 1:
            dist.all_reduce(totals, group=check_group)
            loss_mean, acc = (totals[0] / totals[2]).item(), (totals[1] / totals[2]).item()
            say(rank, f"epoch {epoch + 1}: {step + 1} steps, loss {loss_mean:.4f}, "
                f"accuracy {acc:.4f} (training, every rank)")
            results["epochs"].append({"epoch": epoch + 1, "steps": step + 1,
                                      "loss": loss_mean, "accuracy": acc})
            totals.zero_()
    elapsed = time.perf_counter() - timed_start if timed_start is not None else 0.0
    samples_per_second = timed_samples / elapsed if elapsed > 0 else float("nan")

    test_accuracy = accuracy(model, x_test, y_test)
    say(rank, f"test accuracy: {test_accuracy:.4f} ({y_test.numel()} examples, rank 0's weights)")
    say(rank, f"throughput: {samples_per_second:.0f} samples/s (steps {warmup + 1}-{total_steps}, "
        f"{timed_samples} samples in {elapsed:.2f} s)")
    results.update(test_accuracy=test_accuracy, samples_per_second=samples_per_second)

    # Bit-identical weights: every rank compares its own with rank 0's.
    weights = flat_weights(model)
    reference = weights.clone()
    dist.broadcast(reference, src=0, group=check_group)
    differing = torch.tensor([0.0 if torch.equal(weights, reference) else 1.0])
    dist.all_reduce(differing, group=check_group)
    digest = hashlib.sha256(weights.numpy().tobytes()).hexdigest()[:16]
    identical = differing.item() == 0
    failed = False
    if identical:
        say(rank, f"weights: bit-identical on {world_size} ranks (sha256 {digest})")
    elif args.no_sync:
        say(rank, f"weights: differ on {int(differing.item())} of {world_size} ranks, as they do "
            "without gradient synchronisation (--no-sync)")
    else:
        say(rank, f"weights: FAIL: {int(differing.item())} of {world_size} ranks differ from "
            f"rank 0 (rank 0 sha256 {digest})")
        failed = True
    results["weights_identical"] = identical

    if args.check_single:
        verdict = torch.zeros(1)
        if rank == 0:
            single = train_single(args, x_train, y_train, total_steps, steps_per_epoch)
            max_diff = (flat_weights(single) - weights).abs().max().item()
            ok = max_diff <= args.tolerance
            verdict[0] = 0.0 if ok else 1.0
            say(rank, f"single-process check: max |difference| {max_diff:.3g} over "
                f"{weights.numel()} weights after {total_steps} steps (tolerance "
                f"{args.tolerance:g}): {'PASS' if ok else 'FAIL'}")
            results["single_max_difference"] = max_diff
        dist.broadcast(verdict, src=0, group=check_group)
        failed = failed or verdict.item() != 0

    if rank == 0 and args.json:
        with open(args.json, "w") as f:
            json.dump(results, f, indent=1)
    dist.destroy_process_group()
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
