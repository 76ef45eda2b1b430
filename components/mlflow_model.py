"""The MLflow pyfunc model, defined from code so that nothing is pickled.

Input: a DataFrame with a `history` column (list of item ids, oldest first) and optional
`k`; output: one list of recommended item ids per row.
"""
import mlflow
from mlflow.pyfunc import PythonModel

from lightning_modules.export import Recommender


class HSTURecommender(PythonModel):
    def load_context(self, context):
        self.recommender = Recommender.load(context.artifacts["export"])

    def predict(self, context, model_input, params=None):
        k = int((params or {}).get("k", 10))
        return [[item for item, _ in self.recommender.recommend(list(h), k=k)] for h in model_input["history"]]


mlflow.models.set_model(HSTURecommender())
