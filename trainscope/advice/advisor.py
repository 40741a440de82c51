"""From one run record to "what to try next": every rule's suggestions and the warnings' fixes, ranked.

How it works: docs/tune.md#in-the-code-how-the-advisor-reasons-trainscopeadviceadvisorpy.
"""

from trainscope.advice import changes
from trainscope.advice.device_time import GAP_RULES, gap_evidence, host_bound
from trainscope.advice.rules import (
    Suggestion,
    batch,
    communication,
    cpu_precision,
    data_loading,
    evaluation,
    gpu_batch,
    gpu_precision,
    optimizer,
    padding,
    threads,
)
from trainscope.core import launching
from trainscope.core.record_view import RunView
from trainscope.measure import health

# The rules of trainscope.advice.rules, then the host-bound rule.
RULES = [
    data_loading, threads, padding, evaluation, optimizer, gpu_precision, cpu_precision, batch, gpu_batch,
    communication, host_bound
]  # fmt: skip


def advise(record: dict, in_loop_terms: bool = True) -> list[Suggestion]:
    """Every suggestion the record supports: health warnings first, then by gain, largest first. A function of the
    record alone: every estimate reads the rates recorded with the run (trainscope.advice.estimates), never this
    machine's, so the same record gives the same advice anywhere; a rule that fails says so in its item. On a loop of
    its own each change is said in its terms (`in_loop`), its train.py flags and config kept only without
    `in_loop_terms` (trainscope tune makes them from outside the script)."""
    view = RunView(record)
    found = [s for rule in RULES for s in guarded(rule, view)]
    evidence = guarded(where_the_gap_went, view)[0]
    if isinstance(evidence, Suggestion):  # where the time above the floor went could not be read: said, and no gap rule
        found.append(evidence)
    else:
        found += [s for rule in GAP_RULES for s in guarded(rule, view, evidence)]
    for warning in view.warnings:
        fix = fix_first(warning, view)
        same = next((s for s in found if fix.flags and s.flags == fix.flags), None)
        if same and fix.fix_first:  # the rule's suggestion is the fix: one item, ranked first, with the rule's gain
            same.fix_first, same.evidence = True, f"{same.evidence}; {fix.evidence}"
        else:
            found.append(fix)
    for s in found:
        if s.flags or s.config:
            s.kind, s.unavailable = changes.kind_of(s.flags, s.config), changes.unavailable(s.flags, s.config)
    if view.options_as == "keywords":  # its driver's keywords (a loop of its own, the Trainer's callback): what
        # applies to any model, in the loop's own words
        found = [s for s in found if s.rule not in CLASSIFIER_ONLY]
        for s in found:
            if s.flags or s.config:
                s.in_loop, s.unavailable = changes.loop_words(s.flags, s.config), None
                s.flags, s.config = ([], None) if in_loop_terms else (s.flags, s.config)
    return sorted(found, key=lambda s: (not s.fix_first, s.note is not None, -(s.gain or 1.0)))


def where_the_gap_went(view: RunView) -> list:
    """gap_evidence as a rule's list (None or the evidence), so that advise can guard it like one."""
    return [gap_evidence(view)]


def guarded(rule, *args) -> list[Suggestion]:
    """A rule's suggestions; a rule that raises gives one item that says so (estimate unavailable: why), never an
    exception out of the advice nor a silently missing item."""
    try:
        return rule(*args)
    except Exception as error:  # a defect, or a record of a shape the rule does not expect
        why = f"{type(error).__name__}: {' '.join(str(error).split())[:200]}"
        return [
            Suggestion(
                rule.__name__,
                f"the {rule.__name__.replace('_', ' ')} rule could not read this record",
                "the rule raised",
                estimate_unavailable=why,
                confidence="low",
            )
        ]


# What reads train.py's classifier (its padding and evaluation order, its encoder's attention and dropout) and does
# not apply to a loop of its own (trainscope.Run).
CLASSIFIER_ONLY = {"padding", "unpad", "eval_order", "evaluation", "attention_kernel", "dropout"}
# Warnings about one figure only, not the run's: listed after the suggestions, with what they are about.
ONE_FIGURE = {"prediction_fit_at_bound": "about the prediction only: the run's own figures stand"}


def fix_first(warning: dict, view: RunView) -> Suggestion:
    """A warning's item: its registry entry's fix in the words of whoever ran the run, ranked first where the figures
    themselves are doubtful, after the suggestions where it is about one figure only (ONE_FIGURE)."""
    entry = health.fix_for(warning["code"])
    change, flags = (entry.fix_in(view), list(entry.flags)) if entry else ("see the warning", [])
    note = ONE_FIGURE.get(warning["code"])
    return Suggestion(
        f"warning:{warning['code']}",
        change,
        warning["message"],
        flags,
        fix_first=note is None,
        confidence="high",
        note=note,
    )


def lines(suggestions: list[Suggestion]) -> list[str]:
    """The ranked list for the console and the report."""
    out = []
    for rank, s in enumerate(suggestions, 1):
        what = s.in_loop or " ".join(s.flags) or (launching.config_argument(s.config) if s.config else "")
        kind = f"; {s.kind}" + (f", {s.unavailable}" if s.unavailable else "") if s.kind else ""
        out.append(
            f"{rank}. {s.change}" + (f" (`{what}`{kind})" if what else "") + f" -- {s.gain_text()}, "
            f"confidence {s.confidence}."
        )
        out.append(f"   evidence: {s.evidence}" + (f"; changes: {s.changes_result}" if s.changes_result else ""))
    return out or ["No suggestion: no measured share leaves 2% to gain."]
