"""Accuracy and macro-F1 for single-label classification, as an `evaluate` metric module.

Shipped inside trainscope so that `evaluate.load` works offline: the hub's `accuracy` and `f1`
modules are downloaded scripts (and pull in scikit-learn); this one needs only numpy.
Macro-F1 follows scikit-learn's `f1_score(average="macro")`: the unweighted mean of per-class F1
over the classes present in references or predictions, a class with no true or predicted
positives scoring 0.
"""

import datasets
import evaluate
import numpy as np

_DESCRIPTION = "Accuracy and macro-averaged F1 for single-label classification."
_KWARGS_DESCRIPTION = """
Args:
    predictions (list of int): predicted class ids.
    references (list of int): true class ids.
Returns:
    accuracy (float): fraction of predictions equal to references.
    macro_f1 (float): unweighted mean over classes of 2·TP / (2·TP + FP + FN).
"""


class Classification(evaluate.Metric):
    def _info(self):
        return evaluate.MetricInfo(
            description=_DESCRIPTION,
            citation="",
            inputs_description=_KWARGS_DESCRIPTION,
            features=datasets.Features({"predictions": datasets.Value("int64"), "references": datasets.Value("int64")}),
        )

    def _compute(self, predictions, references):
        predictions = np.asarray(predictions, dtype=np.int64)
        references = np.asarray(references, dtype=np.int64)
        if predictions.size == 0:
            raise ValueError("no predictions to score")
        classes = np.union1d(predictions, references)
        f1_per_class = []
        for c in classes:
            true_positive = np.sum((predictions == c) & (references == c))
            false_positive = np.sum((predictions == c) & (references != c))
            false_negative = np.sum((predictions != c) & (references == c))
            denominator = 2 * true_positive + false_positive + false_negative
            f1_per_class.append(2 * true_positive / denominator if denominator else 0.0)
        return {"accuracy": float(np.mean(predictions == references)), "macro_f1": float(np.mean(f1_per_class))}
