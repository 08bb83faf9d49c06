"""The ``fastppo`` command: one subcommand per job, each parsing its own options (``--help``)."""

import importlib
import sys

# subcommand -> (module whose ``main(argv)`` runs it, one-line help)
COMMANDS = {
    "demo": ("fastppo.demo", "run the log-prob ops on a tiny Llama and compare them with float64 PyTorch"),
    "bench": ("fastppo.bench.cli", "time every op beside naive PyTorch, torch.compile and installed peers"),
    "train": ("fastppo.trainer.cli", "PPO / GRPO training of a Hugging Face causal LM (tiny built-in default)"),
    "plot": ("fastppo.trainer.run.plot", "a PNG of a run's curves (needs matplotlib)"),
}


def main(argv=None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if not argv or argv[0] not in COMMANDS:
        print("usage: fastppo COMMAND [options]\n\ncommands:")
        for name, (_, help_text) in COMMANDS.items():
            print(f"  {name:<8}{help_text}")
        return 0 if not argv or argv[0] in ("-h", "--help") else 2
    module, _ = COMMANDS[argv[0]]
    return importlib.import_module(module).main(argv[1:])


if __name__ == "__main__":
    sys.exit(main())
