"""Tasks: what goes into the tokenizer and what comes out of the model, written once."""

from __future__ import annotations

from ..errors import UnknownTaskError
from ..manifest import Manifest
from .base import Task, TaskInfo, TextInput
from .classification import TextClassification
from .embeddings import SentenceEmbeddings
from .question_answering import QuestionAnswering
from .token_classification import TokenClassification

TASKS: dict[str, type[Task]] = {
    cls.info.name: cls for cls in (TextClassification, SentenceEmbeddings, TokenClassification, QuestionAnswering)
}


def task_class(name: str) -> type[Task]:
    try:
        return TASKS[name]
    except KeyError:
        raise UnknownTaskError(f"unknown task '{name}' (choose from {', '.join(TASKS)}, or auto)") from None


def make_task(manifest: Manifest) -> Task:
    return task_class(manifest.task)(manifest)


__all__ = ["TASKS", "Task", "TaskInfo", "TextInput", "make_task", "task_class"]
