"""Print the keys the installed llamafactory reads from a YAML (run in .venv-llamafactory with
DISABLE_VERSION_CHECK=1), one per line: what ktcore/llamafactory_keys.py lists."""

import dataclasses

import llamafactory
import llamafactory.hparams as hparams

CLASSES = ("ModelArguments", "DataArguments", "TrainingArguments", "FinetuningArguments", "GeneratingArguments",
           "EvaluationArguments", "RayArguments")

if __name__ == "__main__":
    print(f"# llamafactory {llamafactory.__version__}")
    for name in sorted({f.name for c in CLASSES for f in dataclasses.fields(getattr(hparams, c)) if f.init}):
        print(name)
