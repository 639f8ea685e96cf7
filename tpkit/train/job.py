"""JobConfig: the job's sections together, the checks that involve several of them, the checks
that need the layout (``check_layout``), the layout the job asks for, and its TOML form."""
from __future__ import annotations

import dataclasses
import json
from dataclasses import dataclass, field, fields

from .schema import (Checkpoint, Data, Experts, Logging, Model, Optimizer, Parallelism, Pipeline,
                     Precision, Recovery, SECTIONS, Training)


# --- the job --------------------------------------------------------------------------------
@dataclass
class JobConfig:
    """A whole job: one instance of every section. ``origin`` maps ``section.field`` to
    where a value that is not the default came from (``job.toml:12``, ``--steps``,
    ``$TPKIT_HANG_TIMEOUT``)."""
    parallelism: Parallelism = field(default_factory=Parallelism)
    model: Model = field(default_factory=Model)
    data: Data = field(default_factory=Data)
    training: Training = field(default_factory=Training)
    optimizer: Optimizer = field(default_factory=Optimizer)
    precision: Precision = field(default_factory=Precision)
    checkpoint: Checkpoint = field(default_factory=Checkpoint)
    recovery: Recovery = field(default_factory=Recovery)
    pipeline: Pipeline = field(default_factory=Pipeline)
    experts: Experts = field(default_factory=Experts)
    logging: Logging = field(default_factory=Logging)
    origin: dict = field(default_factory=dict, repr=False, compare=False)

    # --- values and where they came from ---------------------------------------------
    def get(self, path: str):
        section, name = path.split(".")
        return getattr(getattr(self, section), name)

    def is_default(self, path: str) -> bool:
        section, name = path.split(".")
        f = {f.name: f for f in fields(getattr(self, section))}[name]
        return self.get(path) == f.default

    def show(self, path: str) -> str:
        """``path``'s value and where it came from, as an error message names it:
        ``--steps=0 (training.steps)``, ``training.steps=0 (job.toml:3)``,
        ``training.steps=300 (default)``."""
        where, value = self.origin.get(path), self.get(path)
        if where and where.startswith("--"):
            if value is True:
                return f"{where} ({path})"
            return f"{where}={value!r} ({path})"
        return f"{path}={value!r} ({where or 'default'})"

    def bad(self, path: str, problem: str) -> ValueError:
        return ValueError(f"{self.show(path)} {problem}")

    # --- checks ----------------------------------------------------------------------
    def check(self) -> "JobConfig":
        """Every check that needs no layout: the data-vs-model clashes, then each section's
        own, in table order (a section may read the others). ValueError, one line, on the
        first bad value."""
        if self.data.pack and self.model.impl == "te":
            raise ValueError(f"{self.show('data.pack')} needs --model.impl torch or auto (TE's"
                             " TransformerLayer is built with attn_input_format='sbhd'); drop "
                             "--pack or set --model.impl torch")
        if self.data.pack and self.model.init_from_hf:
            raise ValueError(f"{self.show('data.pack')} trains the reference GPT; drop "
                             "--init-from-hf or --pack")
        for name in SECTIONS:
            getattr(self, name).check(self)
        return self

    def microbatches(self, pp: int) -> int:
        """Micro-batches per step and dp rank at ``pp`` stages."""
        if self.pipeline.microbatches is not None:
            return self.pipeline.microbatches
        return 2 * pp if pp > 1 else 1

    def check_layout(self, state) -> None:
        """The checks that need the layout ``state`` (a ParallelState, real or planned):
        the batch against dp, the sequence against its shards, the pipeline plan."""
        from ..cp import check_sequence_length
        t, p = self.training, self.pipeline
        if self.experts.num and self.experts.num % state.ep_size:
            raise ValueError(f"{self.show('experts.num')} is not divisible by ep="
                             f"{state.ep_size}; use a multiple of {state.ep_size}")
        if t.global_batch % state.dp_size:
            raise self.bad("training.global_batch", f"is not divisible by dp={state.dp_size};"
                                                    f" use a multiple of {state.dp_size}")
        if self.data.pack:
            return   # packing pads every document to the layout's multiple itself
        try:
            check_sequence_length(t.seq_len, state)
        except ValueError as e:
            raise ValueError(f"{self.show('training.seq_len')}: {e}") from None
        pp, m = state.pp_size, self.microbatches(state.pp_size)
        if pp > 1 and self.data.eval_every:
            raise self.bad("data.eval_every", f"with pipeline stages (pp={pp}) is not "
                                              "supported yet; drop one of them")
        if pp == 1:
            given = [self.show(f"pipeline.{n}") for n in ("virtual_stages", "schedule")
                     if not self.is_default(f"pipeline.{n}")]
            if given:
                raise ValueError(f"{', '.join(given)} only apply with pipeline stages (pp=1 "
                                 "here); add --pp N (N > 1) or drop them")
        else:
            if _tied_hf(self.model.init_from_hf):
                raise ValueError(f"{self.show('model.init_from_hf')} with --pp {pp}: its "
                                 "config.json has tie_word_embeddings=true: the embedding "
                                 "(first stage) and the head (last stage) share one weight; "
                                 "drop it or use --pp 1")
            from ..distributed.pipeline import plan_pipeline
            from .arch import num_layers
            try:
                plan_pipeline(pp=pp, num_blocks=num_layers(self), microbatches=m,
                              schedule=p.schedule, virtual_stages=p.virtual_stages,
                              recompute=t.recompute)
            except ValueError as e:
                raise ValueError(f"--pp {pp} --layers {num_layers(self)} --microbatches {m} "
                                 f"--pp-schedule {p.schedule}: {e}") from None
        r = self.parallelism.dp_replicate
        if state.dp_cp_size % r:
            raise self.bad("parallelism.dp_replicate",
                           f"does not divide the data ranks dp x cp = {state.dp_size} x "
                           f"{state.cp_size} = {state.dp_cp_size}; use a divisor of "
                           f"{state.dp_cp_size}")
        if (t.global_batch // state.dp_size) % m:
            raise ValueError(f"{self.show('training.global_batch')} does not split into dp x "
                             f"microbatches = {state.dp_size} x {m}; use a multiple of "
                             f"{state.dp_size * m} (or change --microbatches)")

    def layout(self, launch=None):
        """The job's layout, not yet checked against a world size (ParallelConfig.validate):
        the parallelism section over the launcher's. ``launch``: tpkit-launch's layout as
        its pre-flight sees it (a ParallelConfig whose ``origin`` names where each value
        came from; every value when it has none): a size given to tpkit-launch's flags and
        here with two values is a ValueError naming both (one run has one layout), and the
        launch then runs this layout (its dry run prints it, its workers read it back).
        Else an environment (default os.environ): its ``TPKIT_*`` are defaults that the
        job's values win over (``ParallelConfig.from_env``)."""
        from ..layout.config import ENV_VARS, ParallelConfig
        job = self

        class _Where(str):   # ParallelConfig's messages name each value's origin
            def format(self, name, flag):
                return job.origin.get(f"parallelism.{name}", f"parallelism.{name}")

        par = self.parallelism
        mine = {n: getattr(par, n) for n in ENV_VARS if getattr(par, n, None) is not None}
        if not isinstance(launch, ParallelConfig):
            return ParallelConfig.from_env(launch, given_as=_Where("job"), **mine)
        given = launch.origin if launch.origin is not None else \
            dict.fromkeys(ENV_VARS, "the launch's layout")
        given = {n: o for n, o in given.items() if getattr(launch, n) is not None}
        for name, value in mine.items():
            if name in given and not given[name].startswith("$") \
                    and getattr(launch, name) != value:
                raise ValueError(
                    f"{self.show(f'parallelism.{name}')} conflicts with {name}="
                    f"{getattr(launch, name)!r} from {given[name]}: one run has one layout; "
                    f"give {name} in one place, or the same value in both")
        env = {var: value for var, value in launch.to_env().items()
               if any(ENV_VARS[n] == var for n in given)}
        config = ParallelConfig.from_env(env, given_as=_Where("job"), **mine)
        origin = {**config.origin, **{n: o for n, o in given.items()
                                      if n in config.origin and n not in mine}}
        return dataclasses.replace(config, origin=origin)

    # --- TOML out --------------------------------------------------------------------
    def to_toml(self) -> str:
        """The resolved job as TOML, every field with its doc; unset (None) fields are
        commented out. ``--config`` of this text reproduces the job."""
        lines = ["# tpkit-train job (tpkit-train --print-config); run it with "
                 "tpkit-train --config FILE"]
        for name in SECTIONS:
            section = getattr(self, name)
            lines += ["", f"[{name}]"]
            for f in fields(section):
                lines.append(f"# {f.metadata['doc']}")
                v = getattr(section, f.name)
                lines.append(f"# {f.name} =   # unset" if v is None
                             else f"{f.name} = {_toml_value(v)}")
        return "\n".join(lines) + "\n"


def _tied_hf(path: str | None) -> bool:
    """model.init_from_hf's config.json ties the embedding and the head (False while it is
    not there: a dry run may plan a download)."""
    import os
    file = path and os.path.join(path, "config.json")
    if not file or not os.path.isfile(file):
        return False
    with open(file) as f:
        return bool(json.load(f).get("tie_word_embeddings", False))


def _toml_value(v) -> str:
    if isinstance(v, bool):
        return "true" if v else "false"
    if isinstance(v, (int, float)):
        return repr(v)
    return json.dumps(v)   # a TOML basic string
