"""The MLflow pyfunc model, defined from code so that nothing is pickled.

Input: a DataFrame with a `history` column (list of item ids, oldest first) and optional
`k` column (default 10); output: one list of recommended item ids per row.
"""
import mlflow
import pandas as pd
from mlflow.pyfunc import PythonModel

from lightning_modules.export import Recommender


class HSTURecommender(PythonModel):
    def load_context(self, context):
        self.recommender = Recommender.load(context.artifacts["export"])

    # (a DataFrame hint: the logged signature describes the input, MLflow infers none)
    def predict(self, context, model_input: pd.DataFrame, params=None) -> list[list[int]]:
        ks = model_input["k"] if "k" in model_input else [10] * len(model_input)
        return [
            [item for item, _ in self.recommender.recommend(list(h), k=int(k))]
            for h, k in zip(model_input["history"], ks)
        ]


mlflow.models.set_model(HSTURecommender())
