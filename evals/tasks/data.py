"""Local data for the offline lm-eval tasks in this folder: `custom_dataset: !function data.load` in a task
YAML reads the JSON file its `dataset_kwargs.file` names, next to this file, so nothing is downloaded and the
tasks run from any working directory. Each file is a JSON list of documents (objects)."""

import json
import os

HERE = os.path.dirname(os.path.abspath(__file__))


def load(file: str = "", **_):
    """{"test": the documents of `file`} as a Hugging Face dataset (lm-eval's custom_dataset hook)."""
    import datasets

    with open(os.path.join(HERE, file), encoding="utf-8") as f:
        return {"test": datasets.Dataset.from_list(json.load(f))}
