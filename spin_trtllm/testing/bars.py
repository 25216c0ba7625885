"""A stand-in for tqdm that records every bar made, so tests can check labels and totals."""

from __future__ import annotations


class RecordingBar:
    made: list["RecordingBar"] = []

    def __init__(self, iterable=None, total=None, **kw):
        self.iterable, self.kw, self.n, self.postfix = iterable, kw, 0, []
        self.total = len(iterable) if total is None and iterable is not None else total
        RecordingBar.made.append(self)

    def __iter__(self):
        for x in self.iterable:
            yield x
            self.n += 1

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        return False

    def update(self, n=1):
        self.n += n

    def set_postfix_str(self, s):
        self.postfix.append(s)

    def set_postfix(self, **kw):
        self.postfix.append(str(kw))

    def close(self):
        pass


def record_bars(monkeypatch) -> list[RecordingBar]:
    """Every tqdm bar made from now on (tqdm.tqdm and the replay's own import) is recorded in
    the returned list."""
    import tqdm

    from ..replay import evaluate

    RecordingBar.made = []
    monkeypatch.setattr(tqdm, "tqdm", RecordingBar)
    monkeypatch.setattr(evaluate, "tqdm", RecordingBar)
    return RecordingBar.made
