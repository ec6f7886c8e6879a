"""TRL's `RepeatSampler` with a shuffle that follows the epoch, so a resume in any epoch sees the uninterrupted data.

TRL's sampler shuffles with its own generator, seeded once and advanced by one permutation per pass over the data.
transformers fast-forwards a resumed run only inside the current epoch and tells the sampler the epoch through
`set_epoch`, which TRL's lacks: a run resumed in epoch 2 or later draws epoch 1's permutation again. Here the
permutation of epoch `e` is a pure function of (seed, e): the generator is seeded again and `e` permutations are
drawn and dropped before the one used, which is the very sequence TRL's sampler draws in an uninterrupted run, so
`DHPOTrainer` and `GRPOTrainer` train on the same data in every epoch.
"""

from __future__ import annotations

import torch
from trl.trainer.utils import RepeatSampler


def epoch_permutation(num_samples: int, seed: int, epoch: int) -> list[int]:
    """The permutation TRL's sampler, seeded with `seed`, draws on its pass number `epoch` (0-based)."""
    generator = torch.Generator()
    generator.manual_seed(seed)
    for _ in range(epoch):  # one randperm per earlier pass; each costs O(num_samples)
        torch.randperm(num_samples, generator=generator)
    return torch.randperm(num_samples, generator=generator).tolist()


class EpochRepeatSampler(RepeatSampler):
    """`RepeatSampler` whose order in epoch `e` is `epoch_permutation(n, seed, e)`.

    `set_epoch` fixes the epoch of the next pass; without it, each pass takes the next epoch (TRL's behaviour).
    """

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        # TRL seeds its generator only when given a seed; an unseeded torch.Generator starts from its default seed.
        self.initial_seed = self.generator.initial_seed() if self.shuffle else None
        self.epoch = 0

    @classmethod
    def like(cls, sampler: RepeatSampler) -> EpochRepeatSampler:
        """This sampler with the settings of TRL's `sampler` (as `GRPOTrainer._get_train_sampler` builds it)."""
        return cls(sampler.data_source, mini_repeat_count=sampler.mini_repeat_count, batch_size=sampler.batch_size,
                   repeat_count=sampler.repeat_count, shuffle=sampler.shuffle, seed=sampler.seed)  # fmt: skip

    def set_epoch(self, epoch: int) -> None:
        self.epoch = int(epoch)

    @staticmethod
    def tell(sampler: EpochRepeatSampler | None, epoch_loop_kwargs: dict) -> None:
        """Tell `sampler` (None: the trainer built none) the epoch of transformers' `_run_epoch` call, if it names one."""
        if sampler is not None and "epoch" in epoch_loop_kwargs:
            sampler.set_epoch(epoch_loop_kwargs["epoch"])

    def __iter__(self):
        epoch, self.epoch = self.epoch, self.epoch + 1
        if not self.shuffle:
            yield from super().__iter__()
            return
        indexes = epoch_permutation(self.num_samples, self.initial_seed, epoch)
        chunks = [indexes[i : i + self.batch_size] for i in range(0, len(indexes), self.batch_size)]
        for chunk in chunks:
            if len(chunk) != self.batch_size:  # TRL drops an incomplete last chunk
                continue
            for _ in range(self.repeat_count):
                for index in chunk:
                    for _ in range(self.mini_repeat_count):
                        yield index
