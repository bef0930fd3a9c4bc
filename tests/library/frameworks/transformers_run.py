"""transformers' ``Trainer`` on 2 CPU ranks, each case with torch's DDP and then with MiniDDP, in the same processes.

    HF_HUB_OFFLINE=1 python -m torch.distributed.run --nproc_per_node 2 tests/library/frameworks/transformers_run.py OUT_DIR CASE...

A GPT-2 built from a tiny config (2 layers, 32 wide: nothing downloaded), three steps on fixed token ids.
MiniDDP is swapped in as ``docs/frameworks.md`` tells a user: :func:`minddp.frameworks.accelerate.use_minddp`
before the ``Trainer`` is built (and :func:`use_torch_ddp` before torch's run). Cases (``CASES``): the
``ddp_find_unused_parameters`` search off and on, activation (gradient) checkpointing, reentrant too, frozen
layers, ``torch.compile``, and a run saved at step 2 and resumed from there. Each rank saves
``OUT_DIR/rank{R}.pt``: by (case, torch|minddp), the losses the Trainer logged, the final parameters and
buffers, and the wrapper's class.
"""

import sys

import torch
from torch.utils.data import Dataset
from transformers import GPT2Config, GPT2LMHeadModel, Trainer, TrainingArguments, set_seed

from both_ddps import save_and_leave, with_each_ddp  # (this script's folder is on sys.path)

torch.set_num_threads(1)

STEPS = 3

# case -> (TrainingArguments beyond the common ones, names of parameters frozen)
CASES = {
    "plain": ({"ddp_find_unused_parameters": False}, ()),
    "find_unused": ({"ddp_find_unused_parameters": True}, ()),
    "checkpointing": ({"activation_checkpointing": True}, ()),
    "checkpointing_reentrant": ({"activation_checkpointing": True,
                                 "activation_checkpointing_kwargs": {"use_reentrant": True}}, ()),
    "frozen": ({"ddp_find_unused_parameters": False}, ("transformer.wte", "transformer.wpe", "transformer.h.0")),
    "compile": ({"torch_compile": True, "torch_compile_backend": "aot_eager"}, ()),
    "resume": ({"save_strategy": "steps", "save_steps": 2, "max_steps": STEPS + 1}, ()),
}


class Tokens(Dataset):
    """Fixed token ids, the labels the ids themselves (the model shifts them)."""

    def __init__(self, count: int = 32, length: int = 16, vocab: int = 64):
        self.ids = torch.randint(vocab, (count, length), generator=torch.Generator().manual_seed(0))

    def __len__(self) -> int:
        return len(self.ids)

    def __getitem__(self, i: int) -> dict:
        return {"input_ids": self.ids[i], "labels": self.ids[i]}


def model(frozen: tuple[str, ...]) -> GPT2LMHeadModel:
    set_seed(0)
    gpt = GPT2LMHeadModel(GPT2Config(n_layer=2, n_embd=32, n_head=2, vocab_size=64, n_positions=16,
                                     tie_word_embeddings=False))
    for name, p in gpt.named_parameters():
        if name.startswith(frozen):
            p.requires_grad_(False)
    return gpt


def train(case: str, out: str) -> dict:
    extra, frozen = CASES[case]
    common = {"per_device_train_batch_size": 2, "learning_rate": 1e-2, "seed": 0, "max_steps": STEPS,
              "logging_steps": 1, "save_strategy": "no", "report_to": [], "use_cpu": True, "ddp_backend": "gloo",
              "disable_tqdm": True, "dataloader_num_workers": 0}
    args = TrainingArguments(output_dir=out, **{**common, **extra})
    trainer = Trainer(model=model(frozen), args=args, train_dataset=Tokens())
    trainer.train()
    if case == "resume":  # a fresh Trainer on a fresh model, from the checkpoint of step 2
        trainer = Trainer(model=model(frozen), args=args, train_dataset=Tokens())
        trainer.train(resume_from_checkpoint=f"{out}/checkpoint-2")
    wrapped = trainer.model_wrapped
    wrapper = type(getattr(wrapped, "_orig_mod", wrapped)).__name__
    return {"losses": [h["loss"] for h in trainer.state.log_history if "loss" in h],
            "state": {name: t.detach().clone() for name, t in trainer.model.state_dict().items()},
            "wrapper": wrapper}


def main(out: str, *cases: str) -> None:
    results = {}
    for case in cases:
        for which, result in with_each_ddp(lambda which: train(case, f"{out}/{case}-{which}")).items():
            results[case, which] = result
    save_and_leave(results, out)


if __name__ == "__main__":
    main(*sys.argv[1:])
