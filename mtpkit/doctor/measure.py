"""--measure: load the checkpoint in mtpkit and measure teacher-mode acceptance on a small
built-in sample, then judge it (about zero: broken head; clearly below a reference: drift)."""

from __future__ import annotations

import os
import tempfile
import warnings
from dataclasses import dataclass

from .findings import Finding, Report

# A few paragraphs of ordinary prose, code and dialogue: enough positions (several hundred
# tokens with a BPE vocabulary, a few thousand characters) for a stable first-draft rate.
SAMPLE = """\
The river had been low all summer, and by September the stones of the old ford showed \
above the water for the first time in twenty years. People from the village walked down in \
the evenings to look at them, as if they were visitors who might leave again at any moment. \
Children counted them, and the oldest woman in the village said that her grandfather had \
crossed there with a cart full of apples, long before the bridge was built.

A good test of a measurement is whether it changes when nothing else does. If you weigh the \
same bag of flour three times and get three different numbers, the scale is telling you \
about itself, not about the flour. The same holds for software: a benchmark that moves by \
ten percent between identical runs cannot detect a five percent regression.

def moving_average(values, window):
    \"\"\"Return the mean of each run of `window` consecutive values.\"\"\"
    if window <= 0:
        raise ValueError("window must be positive")
    total = sum(values[:window])
    out = [total / window]
    for i in range(window, len(values)):
        total += values[i] - values[i - window]
        out.append(total / window)
    return out

"Are you coming to the station?" she asked.
"Only if the train is on time," he said. "Last week I waited for an hour and then it left \
from the other platform."
"Then we should leave now, and you can complain on the way."

The committee met on Tuesday to review the budget for the coming year. Most of the money \
goes to maintenance of roads and schools, with a smaller share for the library and the \
swimming pool. Several members asked whether the heating system in the town hall could be \
replaced before winter, since repairs had already cost more than a new boiler would.

In the morning the fog lay so thick over the fields that the cows seemed to float in it, \
their legs lost in white. By ten o'clock the sun had burned it away, and the whole valley \
was bright and sharp, every fence post and every leaf standing out as if drawn with ink.
"""

ZERO = 0.05  # first-draft acceptance at or below this is "about zero"
DRIFT_RATIO = 0.85  # clearly below the reference: under this fraction of it ...
DRIFT_ABS = 0.03  # ... and at least this many points under it


@dataclass
class Measurement:
    """Teacher-mode acceptance of one checkpoint."""

    path: str
    per_position: list[float]
    positions: int
    loaded_head: bool
    note: str = ""

    @property
    def first(self) -> float:
        """Acceptance of the first draft position."""
        return self.per_position[0] if self.per_position else 0.0


def measure(path, k: int = 2, device: str = "cpu", max_tokens: int = 4096) -> Measurement:
    """Load ``path`` in mtpkit and measure per-position acceptance on the built-in sample."""
    from ..engine.loader import load_model
    from ..train.evaluate import teacher_eval

    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        loaded = load_model(path, device=device)
    notes = "; ".join(str(w.message) for w in caught)
    model = loaded.model
    if model.mtp is None:
        return Measurement(str(path), [], 0, False, notes or "mtpkit loaded no MTP head")
    if loaded.tokenizer is None:
        raise ValueError(f"{path}: no tokenizer to encode the sample with")
    fd, tmp = tempfile.mkstemp(suffix=".txt", prefix="mtpkit-doctor-")
    try:
        with os.fdopen(fd, "w") as fh:
            # Repeat the sample until it fills enough chunks for small vocabularies too.
            fh.write(SAMPLE * 2)
        rep = teacher_eval(model, loaded.tokenizer, [tmp], k, max_tokens, seq_len=128,
                           batch_size=4, draft_vocab=loaded.draft_vocab)
    finally:
        os.unlink(tmp)
    return Measurement(str(path), rep.per_position, rep.positions, True, notes)


def judge(report: Report, m: Measurement, ref: Measurement | None = None) -> None:
    """Add the verdict on a measurement (and its reference) to the report."""
    report.facts["measured"] = {"acceptance_per_position": [round(r, 4) for r in m.per_position],
                                "positions": m.positions}
    if ref is not None:
        report.facts["reference"] = {"path": ref.path, "acceptance_per_position":
                                     [round(r, 4) for r in ref.per_position]}
    if not m.loaded_head:
        report.add(Finding(
            "measure-failed", "error", f"mtpkit loaded no MTP head from {m.path}: {m.note}",
            "there is nothing to measure", "see the static findings above", ["mtpkit"],
            "mtp.*"))
        return
    pct = f"{100 * m.first:.1f}%"
    if m.first <= ZERO or (ref is not None and ref.first > 0 and m.first < 0.1 * ref.first):
        report.add(Finding(
            "mtp-acceptance-zero", "error",
            f"first-draft acceptance is {pct} on the built-in sample"
            + (f" (reference: {100 * ref.first:.1f}%)" if ref else ""),
            "the head's weights are broken or mis-loaded (random or uninitialised weights, a "
            "head from another model, a wrong layout or norm convention)",
            "graft the head from the release it came with: mtpkit graft --from <release> "
            f"--into {m.path} --out <OUT>", ["mtpkit"], "mtp.*"))
        return
    if ref is not None and m.first < DRIFT_RATIO * ref.first and ref.first - m.first >= DRIFT_ABS:
        report.add(Finding(
            "mtp-acceptance-drift", "warning",
            f"first-draft acceptance is {pct}, clearly below the reference's "
            f"{100 * ref.first:.1f}%",
            "the trunk changed (quantization) and the head was trained against the original: "
            "its drafts no longer match what this trunk predicts",
            f"mtpkit calibrate --model {m.path} --init head --data <text> --out <head dir>",
            ["mtpkit"], "mtp.*"))
        return
    report.add(Finding(
        "mtp-acceptance-ok", "info",
        f"first-draft acceptance {pct}"
        + (f" (reference {100 * ref.first:.1f}%)" if ref else "")
        + f"; per position {', '.join(f'{100 * r:.1f}%' for r in m.per_position)}",
        "", "", ["mtpkit"], "mtp.*"))
