"""The MLflow pyfunc model, defined from code so that nothing is pickled.

Input: a DataFrame with a `history` column (list of item ids, oldest first), an optional
`timestamps` column (the times of the history's items, in the training data's unit; a
missing column or value: all 0) and an optional `k` column (default 10); output: one list
of recommended item ids per row.
"""
import mlflow
import numpy as np
import pandas as pd
from mlflow.pyfunc import PythonModel

from lightning_modules.export import Recommender


class HSTURecommender(PythonModel):
    def load_context(self, context):
        self.recommender = Recommender.load(context.artifacts["export"])

    # (a DataFrame hint: the logged signature describes the input, MLflow infers none)
    def predict(self, context, model_input: pd.DataFrame, params=None) -> list[list[int]]:
        rows = len(model_input)
        ks = model_input["k"] if "k" in model_input else [10] * rows
        times = model_input["timestamps"] if "timestamps" in model_input else [None] * rows
        return [
            [item for item, _ in self.recommender.recommend(list(h), _times(t), k=int(k))]
            for h, t, k in zip(model_input["history"], times, ks)
        ]


def _times(value) -> list[int] | None:
    """A row's timestamps: a list, or None where the row has none (None or NaN)."""
    return None if value is None or np.ndim(value) == 0 else [int(t) for t in value]


mlflow.models.set_model(HSTURecommender())
