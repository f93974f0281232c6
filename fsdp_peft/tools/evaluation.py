"""``fsdp-peft eval``: lm-evaluation-harness tasks on an adapter, checkpoint or merged model, sharded when launched so.

check the tasks (`fsdp_peft.tools.eval_tasks`: names, data, documents per rank; before any process group or weights) →
load SOURCE as ``fsdp-peft generate`` does (`fsdp_peft.tools.inference.load_for_generation`) → FSDP2-shard it over the
launched ranks → the harness's evaluator → on rank 0: the harness's own files (``EvaluationTracker``), its table,
``eval.json``. A recipe naming ``eval_tasks`` runs the same evaluation on its trained model
(`evaluate_trained_model`, from `fsdp_peft.procedures.ending`), and every ``eval_tasks_steps`` steps
(`HarnessDuringTraining`).

`HarnessLM` is the model as the harness sees it, the same class in one process and on several ranks. The
evaluator gives each rank every ``world_size``-th document and pads the ranks to equal request counts; it reaches
the ranks only through the LM's ``rank``/``world_size``/``all_gather``/``gather_object``/``barrier``, which here
are torch.distributed's (no accelerate). The sharded model stays sharded: each request type runs inside one
`parameters_gathered` block (units gathered once per call, up to the gather budget), and when not every unit fits,
the ranks run the same number of forwards and ``generate`` calls.

Scoring follows training, not the harness's own ``HFLM``: context and continuation are tokenized apart with no
special tokens (as the recipes tokenize prompt and answer), and log-probabilities are taken in fp32 whatever the
model's dtype. Generation is `fsdp_peft.tools.generation`'s, so a task's greedy completions are the recipes'.
"""

from __future__ import annotations

import contextlib
import gc
import json
import math
import random
import time
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import torch
import torch.distributed as dist
from lm_eval import simple_evaluate
from lm_eval.api.model import LM
from lm_eval.loggers import EvaluationTracker
from lm_eval.models.utils import normalize_gen_kwargs
from lm_eval.utils import get_rolling_token_windows, make_disjoint_window, make_table
from transformers import Trainer, TrainerCallback

from fsdp_peft.core.distributed import gathered_from_every_rank, ranks, release_process_group, start_process_group
from fsdp_peft.core.errors import ConfigError
from fsdp_peft.core.log import counted, logger
from fsdp_peft.core.run_file_names import HARNESS_DIR, HARNESS_LOG_PREFIX
from fsdp_peft.model.modeling import local_device
from fsdp_peft.parallel.fsdp_policies import shard_for_generation
from fsdp_peft.tools.decoding import compiles_here
from fsdp_peft.tools.eval_tasks import EVAL_TASKS_KEY, HarnessTasks, load_tasks
from fsdp_peft.tools.generation import (
    GenerationSettings,
    complete_on_this_rank,
    evaluation_mode,
    group_ranks,
    parameters_gathered,
    parse_gather_budget,
)
from fsdp_peft.tools.inference import load_for_generation
from fsdp_peft.tools.runs import RUN_FILE

EVAL_FILE = "eval.json"
DEFAULT_MAX_GEN_TOKS = 256  # the harness's own default, for a generate_until task that sets none


class HarnessLM(LM):
    """The (possibly FSDP2-sharded) model as the harness's evaluator calls it, on one rank or several."""

    def __init__(
        self,
        model,
        tokenizer,
        device: torch.device,
        batch_size: int = 32,
        gather_budget: str = "auto",
        merged_adapter: bool = True,
        compiled: str = "auto",
    ):
        super().__init__()
        self.model, self.tokenizer, self._device = model, tokenizer, device
        self.batch_size, self.gather_budget, self.merged_adapter = batch_size, gather_budget, merged_adapter
        self.compiled = compiled
        self._rank, self._world_size = group_ranks()
        text_config = model.config.get_text_config()
        self.max_length = getattr(text_config, "max_position_embeddings", None) or tokenizer.model_max_length

    # the evaluator's only ways to reach the other ranks
    def all_gather(self, tensor: torch.Tensor) -> torch.Tensor:
        if self.world_size == 1:
            return tensor
        parts = [torch.zeros_like(tensor) for _ in range(self.world_size)]
        dist.all_gather(parts, tensor)
        return torch.stack(parts) if tensor.dim() == 0 else torch.cat(parts)

    def gather_object(self, obj, dst: int = 0):
        if self.world_size == 1:
            return [obj]
        gathered = [None] * self.world_size if self.rank == dst else None
        dist.gather_object(obj, gathered, dst=dst)
        return gathered

    def barrier(self) -> None:
        if self.world_size > 1:
            dist.barrier()

    @property
    def tokenizer_name(self) -> str:
        return str(self.tokenizer.name_or_path).replace("/", "__")

    def chat_template(self, chat_template: bool | str = False) -> str | None:
        return self.tokenizer.chat_template if chat_template else None

    def apply_chat_template(self, chat_history: list[dict[str, str]], add_generation_prompt: bool = True) -> str:
        """As `fsdp_peft.data.render_prompt` renders a prompt for training and generation."""
        if not self.tokenizer.chat_template:
            raise ConfigError("--chat: the tokenizer has no chat template; pass --no-chat")
        return self.tokenizer.apply_chat_template(
            chat_history, tokenize=False, add_generation_prompt=add_generation_prompt
        )

    def _encode(self, text: str) -> list[int]:
        return self.tokenizer(text, add_special_tokens=False)["input_ids"]

    def _prefix_token(self) -> int:
        """What an empty context starts from: BOS, else EOS (the harness's ``prefix_token_id``)."""
        bos = self.tokenizer.bos_token_id
        return bos if bos is not None else self.tokenizer.eos_token_id

    def loglikelihood(self, requests) -> list[tuple[float, bool]]:
        pairs = []
        for request in requests:
            context, continuation = request.args
            spaces = len(context) - len(context.rstrip())  # the harness's rule: a context's trailing spaces
            if spaces:  # belong to the continuation
                context, continuation = context[:-spaces], context[-spaces:] + continuation
            context_ids = self._encode(context) if context else [self._prefix_token()]
            pairs.append((context_ids, self._encode(continuation)))
        return self._score(pairs)

    def loglikelihood_rolling(self, requests) -> list[float]:
        """Each text scored whole, in windows of at most the model's positions (the harness's windows)."""
        windows, owners = [], []
        for index, request in enumerate(requests):
            (text,) = request.args
            for window in get_rolling_token_windows(
                self._encode(text), self._prefix_token(), self.max_length, context_len=1
            ):
                windows.append(make_disjoint_window(window))
                owners.append(index)
        totals = [0.0] * len(requests)
        for owner, (logprob, _) in zip(owners, self._score(windows)):
            totals[owner] += logprob
        return totals

    @torch.no_grad()
    def _score(self, pairs: list[tuple[list[int], list[int]]]) -> list[tuple[float, bool]]:
        """Summed log-probability of each continuation after its context (token ids), and whether greedy decoding
        gives every one of its tokens: right-padded batches, log-softmax in fp32 over the continuation only.
        Collective: when the ranks are kept in step, every rank runs the most forwards any rank needs."""
        order = sorted(range(len(pairs)), key=lambda i: -(len(pairs[i][0]) + len(pairs[i][1])))
        batches = [order[i : i + self.batch_size] for i in range(0, len(order), self.batch_size)]
        results: list[tuple[float, bool] | None] = [None] * len(pairs)
        with parameters_gathered(self.model, parse_gather_budget(self.gather_budget)) as whole:
            count = len(batches)
            if self.world_size > 1 and not whole:  # every forward is collective: the same number on every rank
                count = max(gathered_from_every_rank(count))
            with evaluation_mode(self.model, self.tokenizer):
                for index in range(count):
                    batch = batches[index] if index < len(batches) else []
                    rows = [self._row(*pairs[i]) for i in batch] or [([self._prefix_token()] * 2, 1)]  # a placeholder
                    logits = self._forward([ids for ids, _ in rows])
                    for i, (ids, scored), row_logits in zip(batch, rows, logits):
                        targets = torch.tensor(ids[len(ids) - scored :], device=row_logits.device)
                        logprobs = row_logits[len(ids) - scored - 1 : len(ids) - 1].float().log_softmax(-1)
                        total = logprobs.gather(-1, targets[:, None]).sum().item()
                        results[i] = (total, bool((logprobs.argmax(-1) == targets).all()))
        return results

    def _row(self, context: list[int], continuation: list[int]) -> tuple[list[int], int]:
        """The tokens one forward reads (context and continuation, the oldest cut to fit the model's positions,
        ``max_length + 1`` since the last token is only predicted) and how many at its end are scored."""
        ids = (context + continuation)[-(self.max_length + 1) :]
        return ids, min(len(continuation), len(ids) - 1)

    def _forward(self, rows: list[list[int]]) -> torch.Tensor:
        """Logits of each row's tokens but its last (which is only predicted), rows right-padded."""
        width = max(len(ids) for ids in rows) - 1
        pad = self.tokenizer.pad_token_id
        inputs = torch.full((len(rows), max(width, 1)), pad, dtype=torch.long)
        mask = torch.zeros_like(inputs)
        for row, ids in enumerate(rows):
            inputs[row, : len(ids) - 1] = torch.tensor(ids[:-1], dtype=torch.long)
            mask[row, : len(ids) - 1] = 1
        return self.model(input_ids=inputs.to(self.device), attention_mask=mask.to(self.device)).logits

    def generate_until(self, requests) -> list[str]:
        """Completions through `fsdp_peft.tools.generation`, grouped by generation settings, all inside one gather;
        each cut at its first stop string."""
        groups: dict[str, list[int]] = {}
        for index, request in enumerate(requests):
            groups.setdefault(json.dumps(request.args[1], sort_keys=True, default=str), []).append(index)
        completions: list[str] = [""] * len(requests)
        budget = parse_gather_budget(self.gather_budget)
        dequantized = compiles_here(self.model, self.compiled)
        with parameters_gathered(self.model, budget, self.merged_adapter, dequantized) as whole:
            synced = self.world_size > 1 and not whole
            counts = {key: len(indices) for key, indices in groups.items()}
            plan = gathered_from_every_rank(counts) if synced else [counts]
            for key in sorted({key for rank_counts in plan for key in rank_counts}):
                indices = groups.get(key, [])
                settings, until = self._settings(json.loads(key))
                calls = None
                if synced:  # the same calls on every rank: a rank with fewer prompts completes placeholders
                    calls = math.ceil(max(rank_counts.get(key, 0) for rank_counts in plan) / settings.batch_size)
                prompts = [requests[i].args[0] for i in indices]
                self._check_length(prompts, settings.max_new_tokens)
                texts = complete_on_this_rank(
                    self.model, self.tokenizer, prompts, settings, self.device, calls, requests[0].args[0], whole=whole
                )
                for i, text in zip(indices, texts):
                    completions[i] = _cut_at_stop(text, until)
        return completions

    def _settings(self, kwargs: dict) -> tuple[GenerationSettings, list[str]]:
        """The harness's generation kwargs (normalized as its own models normalize them) as `GenerationSettings`,
        and the stop strings, EOS among them. Sampling needs ``do_sample`` and a temperature above 0."""
        kwargs = normalize_gen_kwargs(kwargs, DEFAULT_MAX_GEN_TOKS)
        until = list(kwargs["until"])
        if self.tokenizer.eos_token and self.tokenizer.eos_token not in until:
            until.append(self.tokenizer.eos_token)
        temperature = float(kwargs.get("temperature") or 0.0)
        do_sample = bool(kwargs["do_sample"]) and temperature > 0.0
        settings = GenerationSettings(
            max_new_tokens=kwargs["max_gen_toks"],
            batch_size=self.batch_size,
            do_sample=do_sample,
            temperature=temperature if do_sample else 1.0,
            top_p=float(kwargs.get("top_p") or 1.0),
            gather_budget=self.gather_budget,
            merged_adapter=self.merged_adapter,
            compiled=self.compiled,
            stop_strings=tuple(stop for stop in until if stop and stop != self.tokenizer.eos_token),
        )
        return settings, until

    def _check_length(self, prompts: list[str], max_new_tokens: int) -> None:
        longest = max((len(self._encode(prompt)) for prompt in prompts), default=0)
        if longest + max_new_tokens > self.max_length:
            raise ConfigError(
                f"a prompt of {longest} tokens plus max_gen_toks {max_new_tokens} exceeds the model's "
                f"{self.max_length} positions; lower max_gen_toks (--max-gen-toks N) or shorten the task's prompts"
            )


def _cut_at_stop(text: str, until: list[str]) -> str:
    """The completion up to its first stop string, as the harness's own models cut it."""
    for stop in until:
        if stop:
            text = text.split(stop)[0]
    return text


def evaluate_tasks(
    lm: HarnessLM,
    tasks: HarnessTasks,
    out: Path,
    model_args: dict,
    chat: bool,
    limit: int | None = None,
    gen_kwargs: dict | None = None,
    about: dict | None = None,
) -> dict | None:
    """Run the harness on every rank; rank 0 saves its files as its own command does (``EvaluationTracker`` under
    ``out``), prints its table and writes ``out/eval.json``, whose content it returns (``None`` on other ranks).

    ``model_args`` names the model in the harness's files (``pretrained``, ``peft``); ``about`` is added to
    ``eval.json`` as it is.
    """
    tracker = EvaluationTracker(output_path=str(out))
    started = time.perf_counter()
    results = simple_evaluate(
        model=lm,
        model_args=model_args,
        tasks=tasks.items,
        task_manager=tasks.manager,
        limit=limit,
        apply_chat_template=chat,
        log_samples=True,
        bootstrap_iters=0,
        gen_kwargs=gen_kwargs or None,
        evaluation_tracker=tracker,
    )
    seconds = time.perf_counter() - started
    if results is None:
        return None
    samples = results.pop("samples")
    tracker.save_results_aggregated(results=results, samples=samples)
    for name in results["configs"]:
        tracker.save_results_samples(task_name=name, samples=samples[name])
    folder = out / tracker.general_config_tracker.model_name_sanitized
    results_file = folder / f"results_{tracker.date_id}.json"
    if not results_file.is_file():  # the tracker reports a failed write as a warning only
        raise ConfigError(f"--out: could not write the harness's results into {folder}")
    print(make_table(results))
    if results.get("groups"):
        print(make_table(results, "groups"))
    counts = {name: results["n-samples"][name]["effective"] for name in results["configs"]}
    summary = {
        **(about or {}),
        "chat": chat,
        "limit": limit,
        "world_size": lm.world_size,
        "tasks": {name: {"samples": counts[name], **_metrics(results["results"][name])} for name in counts},
        "evaluate_seconds": seconds,
        "seconds_per_sample": seconds / max(1, sum(counts.values())),
        "results_file": str(results_file),
        "samples_files": {name: str(folder / f"samples_{name}_{tracker.date_id}.jsonl") for name in counts},
    }
    (out / EVAL_FILE).write_text(json.dumps(summary, indent=1))
    return summary


def _metrics(task_results: dict) -> dict:
    """A task's figures as the harness keys them (``metric,filter``), without their standard errors."""
    return {key: value for key, value in task_results.items() if "," in key and "_stderr," not in key}


def evaluate_trained_model(
    model, tokenizer, recipe: dict, out: Path, source: str, device: torch.device, step: int | None = None
) -> dict | None:
    """A recipe's ``eval_tasks`` on its model as the trainer holds it (sharded; every rank calls this): the harness's
    files and ``eval.json`` in ``out``; on rank 0 ``eval.json``'s content (``None`` elsewhere).

    ``recipe`` is the recipe's config (the trainer's ``recipe_config``); ``source`` names the adapter in the
    harness's files (the saved adapter at the end, the output_dir at a step); ``step`` says when, during training.
    """
    _, world = group_ranks()
    tasks = load_tasks(list(recipe["eval_tasks"]), [], None, world, key=EVAL_TASKS_KEY)
    when = f"at step {step}" if step is not None else "on the trained model"
    logger.info(f"harness tasks {when}: {', '.join(tasks.tasks)}")
    settings = (recipe["generate_batch_size"], recipe["generate_gather_budget"], recipe["generate_merged_adapter"])
    lm = HarnessLM(model, tokenizer, device, *settings, recipe.get("generate_compiled", "auto"))
    model_args = {"pretrained": str(recipe["model_name_or_path"]), "peft": source}
    held = "as the trainer holds it" if step is None else f"as the trainer holds it at step {step}"
    about = {"source": source, "model": f"{recipe['model_name_or_path']} + adapter, {held}", "base_only": False}
    about["step"] = step
    with random_states_kept(device):
        return evaluate_tasks(lm, tasks, out, model_args, recipe["use_chat_template"], about=about)


@contextlib.contextmanager
def random_states_kept(device: torch.device) -> Iterator[None]:
    """Python's, numpy's and torch's generators as they were before the block: the harness seeds all three for its
    own reproducibility (1234), which would otherwise change every draw training makes after an evaluation."""
    python_state, numpy_state = random.getstate(), np.random.get_state()
    gpus = [device.index or 0] if device.type == "cuda" else []
    try:
        with torch.random.fork_rng(devices=gpus):
            yield
    finally:
        random.setstate(python_state)
        np.random.set_state(numpy_state)


class HarnessDuringTraining(TrainerCallback):
    """``eval_tasks`` every ``eval_tasks_steps`` optimizer steps, on the model as the trainer holds it (sharded,
    every rank taking its documents): figures logged through the trainer (console, ``report_to``,
    ``trainer_state.json``) as ``harness/<task>/<metric>``; the harness's files in ``output_dir/eval/step-N``.

    The evaluation of the last step is kept (`latest`): the run's end reports it rather than evaluating the same
    weights again.
    """

    def __init__(self, trainer):
        self.trainer = trainer
        self.every = trainer.recipe_config["eval_tasks_steps"]
        self.latest: tuple[int, dict | None] | None = None  # (step, rank 0's eval.json content)

    def on_step_end(self, args, state, control, **kwargs):
        step = state.global_step
        if step % self.every:
            return
        out = Path(args.output_dir) / HARNESS_DIR / f"step-{step}"
        trainer = self.trainer
        summary = evaluate_trained_model(
            trainer.model, trainer.processing_class, trainer.recipe_config, out, args.output_dir, args.device, step
        )
        figures = gathered_from_every_rank(summary["tasks"] if summary is not None else None)[0]  # rank 0's, everywhere
        should_log = control.should_log  # Trainer.log clears it: the step's own log (its loss) must still follow
        Trainer.log(trainer, harness_log_entry(figures))  # not TRL's log, which folds its stored metrics in and
        control.should_log = should_log  # clears them
        self.latest = (step, summary)


def harness_log_entry(figures: dict) -> dict[str, float]:
    """A harness evaluation's figures as the trainer logs them: ``harness/<task>/<metric>`` (``metric`` keyed as
    the harness keys it, ``metric,filter``), the document counts left out."""
    return {
        f"{HARNESS_LOG_PREFIX}{task}/{metric}": value
        for task, values in figures.items()
        for metric, value in values.items()
        if metric != "samples"
    }


def run_eval(args) -> None:
    """The ``eval`` command: check the tasks, join the process group, load (and shard) SOURCE, evaluate."""
    world = ranks().world_size
    tasks = load_tasks(_task_specs(args.tasks), args.include_path or [], args.limit, world)
    out = _output_dir(args.out if args.out is not None else default_output_dir(args.source, args.base_only))
    start_process_group()
    try:
        device = local_device()
        loaded = load_for_generation(args.source, args.base, device, args.allow_base_mismatch, args.base_only)
        if world > 1:
            shard_for_generation(loaded.model, device)
        chat = args.chat if args.chat is not None else bool(loaded.chat)
        where = f", sharded over {world} ranks" if world > 1 else ""
        logger.info(f"evaluating {loaded.description}{where} on {', '.join(tasks.tasks)}")
        lm = HarnessLM(
            loaded.model,
            loaded.tokenizer,
            device,
            args.batch_size,
            args.gather_budget,
            not args.unmerged_adapter,
            args.compiled,
        )
        model_args = {"pretrained": str(loaded.base_dir or args.source)}
        if loaded.adapter_dir is not None:
            model_args["peft"] = str(loaded.adapter_dir)
        about = {"source": str(args.source), "model": loaded.description, "base_only": args.base_only}
        gen_kwargs = {"max_gen_toks": args.max_gen_toks} if args.max_gen_toks else None
        summary = evaluate_tasks(lm, tasks, out, model_args, chat, args.limit, gen_kwargs, about)
        if summary is not None:
            logger.info(
                f"{counted(sum(task['samples'] for task in summary['tasks'].values()), 'sample')} in "
                f"{summary['evaluate_seconds']:.1f} s ({summary['seconds_per_sample'] * 1000:.1f} ms per sample)"
            )
            logger.info(f"results: {out / EVAL_FILE} and {summary['results_file']}")
        del lm, loaded  # the sharded model holds the process group; released below
        gc.collect()
    finally:
        release_process_group()


def _task_specs(text: str) -> list[str]:
    return [spec.strip() for spec in (text or "").split(",") if spec.strip()]


def default_output_dir(source: Path, base_only: bool = False) -> Path:
    """Where ``eval`` writes without ``--out``: inside the evaluated run, never the current directory, where
    results would land in whatever checkout it is (and overwrite the last evaluation's files there).

    ``SOURCE/eval``; for a run's ``adapter/`` or ``checkpoint-N/``, ``<output_dir>/eval/<its name>``, beside the
    run's own harness files, so that checkpoint rotation does not delete them; ``.../base-only`` for the base.
    """
    source = Path(source)
    if not source.exists():
        raise ConfigError(f"SOURCE: {source} does not exist")
    if not source.is_dir():
        raise ConfigError(
            f"SOURCE: {source} is not a directory; give a run's directory, or say where results go with --out DIR"
        )
    in_a_run = (source.parent / RUN_FILE).is_file()
    folder = source.parent / HARNESS_DIR / source.name if in_a_run else source / HARNESS_DIR
    return folder / "base-only" if base_only else folder


def _output_dir(path: Path) -> Path:
    path = Path(path)
    if path.exists() and not path.is_dir():
        raise ConfigError(f"--out: {path} is a file; name a directory (created if missing)")
    path.mkdir(parents=True, exist_ok=True)
    return path
