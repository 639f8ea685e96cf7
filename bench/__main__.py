"""Run every benchmark and rewrite BENCHMARKS.md: ``python -m bench [name ...]``."""
import importlib
import sys

# Each module has main() that measures and calls bench.common.write_section.
BENCHMARKS = ["tp_layers", "context_parallel", "launch", "train", "hf", "recovery", "pipeline", "moe",
              "observe", "data", "compile", "fsdp"]


def main(argv=None) -> None:
    names = (argv if argv is not None else sys.argv[1:]) or BENCHMARKS
    for name in names:
        if name not in BENCHMARKS:
            raise SystemExit(f"unknown benchmark {name!r}; choose from {BENCHMARKS}")
        try:
            mod = importlib.import_module(f"bench.{name}")
        except ModuleNotFoundError as e:
            if e.name == f"bench.{name}":
                print(f"[bench] {name}: not written yet, skipped", flush=True)
                continue
            raise
        print(f"[bench] {name} ...", flush=True)
        mod.main()


if __name__ == "__main__":
    main()
