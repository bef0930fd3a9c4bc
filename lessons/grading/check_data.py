"""Check of exercise 09, the distributed sampler: in this process, against torch's DistributedSampler."""

from __future__ import annotations

import torch.utils.data

from lessons.grading.runner import load

# (dataset size, ranks): 2 samples on 5 ranks need 3 of padding, more than the list: padded from its start twice
CASES = [(11, 3), (12, 4), (10, 4), (2, 3), (12, 3), (2, 5)]


def torch_indices(n, rank, p, epoch, seed, shuffle, drop_last):
    sampler = torch.utils.data.DistributedSampler(range(n), num_replicas=p, rank=rank, shuffle=shuffle, seed=seed,
                                                  drop_last=drop_last)
    sampler.set_epoch(epoch)
    return list(sampler)


def check_09(path: str) -> list[str]:
    exercise = load(path)
    with torch.random.fork_rng(devices=[]):  # the learner's sampler may draw from (or reseed) the global generator
        global_state = torch.get_rng_state()
        difference = first_difference(exercise)
        reseeded = not torch.equal(torch.get_rng_state(), global_state)
    if difference:
        return [difference]
    if reseeded:
        return ["the right indices, but your sampler changed torch's global random generator (torch.manual_seed?): "
                "every other random draw of the program (dropout, augmentations) would then repeat the same numbers "
                "every epoch. Shuffle with a torch.Generator of your own, seeded with seed + epoch"]
    return []


def first_difference(exercise) -> str | None:
    """The first case where the learner's ranks read other indices than torch's sampler gives, explained."""
    for n, p in CASES:
        for drop_last in (False, True):
            for shuffle in (True, False):
                for epoch, seed in ((0, 0), (1, 0), (0, 7)):
                    mine = [list(exercise.rank_indices(n, r, p, epoch=epoch, seed=seed, shuffle=shuffle, drop_last=drop_last))
                            for r in range(p)]
                    right = [torch_indices(n, r, p, epoch, seed, shuffle, drop_last) for r in range(p)]
                    if mine != right:
                        return explain(exercise, mine, right, n, p, epoch, seed, shuffle, drop_last)
    return None


def explain(exercise, mine, right, n, p, epoch, seed, shuffle, drop_last) -> str:
    case = (f"for {n} samples on {p} ranks (epoch {epoch}, seed {seed}, shuffle={shuffle}, "
            f"drop_last={drop_last})")
    counts = [len(m) for m in mine]
    if len(set(counts)) > 1:
        return (f"{case} the ranks got {counts} indices: every rank must get the same number, or the one that runs "
                f"out first leaves the others waiting in an all-reduce: "
                + ("cut the list to a multiple of the rank count" if drop_last else
                   "pad the list with its first indices up to a multiple of the rank count (from its start again "
                   "when the padding is longer than the list)"))
    if counts[0] != len(right[0]):
        return f"{case} each rank got {counts[0]} indices, torch's sampler gives {len(right[0])}"
    flat = [i for m in mine for i in m]
    if n % p == 0 and len(set(flat)) < len(flat):
        twice = next(i for i in flat if flat.count(i) > 1)
        holders = [r for r, m in enumerate(mine) if twice in m]
        return f"{case} sample {twice} is read by ranks {holders}: the ranks must read different samples"
    if not drop_last and set(flat) != set(range(n)):
        return f"{case} samples {sorted(set(range(n)) - set(flat))} are read by no rank"
    if shuffle and epoch == 1 and mine == [list(exercise.rank_indices(n, r, p, epoch=0, seed=seed, shuffle=True,
                                                                           drop_last=drop_last)) for r in range(p)]:
        return (f"{case} epoch 1 reads the same order as epoch 0: seed the shuffle with seed + epoch, or every "
                f"epoch repeats the first (what forgetting set_epoch does)")
    if shuffle and seed == 7 and mine == [list(exercise.rank_indices(n, r, p, epoch=epoch, seed=0, shuffle=True,
                                                                          drop_last=drop_last)) for r in range(p)]:
        return f"{case} seed 7 gives the same order as seed 0: the seed must enter the generator"
    interleaved = lambda ranks: [ranks[r][i] for i in range(len(ranks[0])) for r in range(p)]  # noqa: E731
    listed, wanted = interleaved(mine), interleaved(right)
    if not drop_last and n % p and listed[:n] == wanted[:n] and listed[n:] != wanted[n:]:
        return (f"{case} the list before padding is right, the padding is not: yours adds {listed[n:]}, torch's "
                f"sampler adds {wanted[n:]}, the list's own first indices (from its start again when the padding is "
                f"longer than the list)")
    if sorted(flat) == sorted(i for m in right for i in m):
        return (f"{case} your ranks read the right samples but split them differently from torch's sampler "
                f"(yours: {mine}, torch's: {right}): rank r takes the indices at positions r, r + {p}, r + {2 * p}, ... of the list")
    return f"{case} yours: {mine}, torch's sampler: {right}"
