"""Progress displays of the command line that more than one command shows.

- :func:`prepare_with_progress`: ``hivepath data prepare`` and ``hivepath train-local`` (which
  prepares the built-in corpus on first use) run :func:`models.data.prepare` on
  :func:`models.corpus.select_corpus` behind a spinner naming the stage and the documents done.
"""

from __future__ import annotations

from typing import Optional, Sequence

__all__ = ["prepare_with_progress"]


def prepare_with_progress(sources: Sequence[str], corpus: Optional[str], out: str, levels: int, modules: int,
                          tokenizer: str, seed: int = 0) -> dict:
    """Prepare a dataset from ``sources`` or the ``corpus`` named (:func:`models.corpus.select_corpus`)
    with a transient rich display; returns the manifest."""
    from rich.progress import Progress, SpinnerColumn, TextColumn, TimeElapsedColumn

    from models.corpus import select_corpus
    from models.data import prepare

    with Progress(SpinnerColumn(), TextColumn("{task.description}"), TextColumn("{task.completed} documents"),
                  TimeElapsedColumn(), transient=True) as bar:
        task = bar.add_task("preparing", total=None)
        return prepare(select_corpus(sources, corpus), out, levels=levels, modules=modules, tokenizer=tokenizer,
                       seed=seed, progress=lambda stage, n: bar.update(task, description=stage, completed=n))
