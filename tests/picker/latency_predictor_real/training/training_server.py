# Copyright 2025 The Kubernetes Authors.
#
# Licensed under the Apache License, Version 2.0 (the "License");
# you may not use this file except in compliance with the License.
# You may obtain a copy of the License at
#
#     http://www.apache.org/licenses/LICENSE-2.0
#
# Unless required by applicable law or agreed to in writing, software
# distributed under the License is distributed on an "AS IS" BASIS,
# WITHOUT WARRANTIES OR CONDITIONS OF ANY KIND, either express or implied.
# See the License for the specific language governing permissions and
# limitations under the License.
from __future__ import annotations

import io
import json
import logging
import os  # Added this import
import random
import tarfile
import threading
import time
from collections import deque
from datetime import UTC, datetime

import joblib
import numpy as np
import pandas as pd
import uvicorn
from fastapi import FastAPI, HTTPException, status
from fastapi.responses import FileResponse, JSONResponse, Response, StreamingResponse
from pydantic import BaseModel, Field
from scipy.stats import norm
from sklearn.linear_model import BayesianRidge
from sklearn.preprocessing import StandardScaler

try:
    import xgboost as xgb

    XGBOOST_AVAILABLE = True
except (ImportError, OSError) as e:
    xgb = None
    XGBOOST_AVAILABLE = False
    logging.warning("XGBoost not available: %s. Please install with: pip install xgboost", e)

try:
    import lightgbm as lgb

    LIGHTGBM_AVAILABLE = True
except (ImportError, OSError) as e:
    LIGHTGBM_AVAILABLE = False
    lgb = None
    logging.warning("LightGBM not available: %s. Please install with: pip install lightgbm", e)

from common.types import ModelType, ObjectiveType, QueueGatedModel, RandomDropDeque


@staticmethod
def _drop_timestamp(rows: list[dict]) -> list[dict]:
    return [{k: v for k, v in row.items() if k != "timestamp"} for row in rows]

# --- Configuration ---
class Settings:
    """
    Configuration class for the latency predictor server.
    Reads settings from environment variables with sensible defaults.
    """

    TTFT_MODEL_PATH: str = os.getenv("LATENCY_TTFT_MODEL_PATH", "/tmp/models/ttft.joblib")
    TPOT_MODEL_PATH: str = os.getenv("LATENCY_TPOT_MODEL_PATH", "/tmp/models/tpot.joblib")
    TTFT_SCALER_PATH: str = os.getenv("LATENCY_TTFT_SCALER_PATH", "/tmp/models/ttft_scaler.joblib")
    TPOT_SCALER_PATH: str = os.getenv("LATENCY_TPOT_SCALER_PATH", "/tmp/models/tpot_scaler.joblib")
    RETRAINING_INTERVAL_SEC: int = int(os.getenv("LATENCY_RETRAINING_INTERVAL_SEC", 1800))
    MIN_SAMPLES_FOR_RETRAIN_FRESH: int = int(os.getenv("LATENCY_MIN_SAMPLES_FOR_RETRAIN_FRESH", 10))
    MIN_SAMPLES_FOR_RETRAIN: int = int(os.getenv("LATENCY_MIN_SAMPLES_FOR_RETRAIN", 1000))
    MAX_TRAINING_DATA_SIZE_PER_BUCKET: int = int(os.getenv("LATENCY_MAX_TRAINING_DATA_SIZE_PER_BUCKET", 500))
    TEST_TRAIN_RATIO: float = float(os.getenv("LATENCY_TEST_TRAIN_RATIO", "0.1"))  # Default 1:10 (10% test, 90% train)
    MAX_TEST_DATA_SIZE: int = int(os.getenv("LATENCY_MAX_TEST_DATA_SIZE", "1000"))  # Max test samples to keep
    MODEL_TYPE: str = os.getenv("LATENCY_MODEL_TYPE", "xgboost")  # Default to XGBoost
    QUANTILE_ALPHA: float = float(os.getenv("LATENCY_QUANTILE_ALPHA", "0.9"))  # p90 quantile
    OBJECTIVE_TYPE: ObjectiveType = ObjectiveType(os.getenv("LATENCY_OBJECTIVE_TYPE", "quantile"))
    SAMPLE_WEIGHTING_FOR_PREFIX_CACHE: bool = (
        os.getenv("LATENCY_SAMPLE_WEIGHTING_FOR_PREFIX_CACHE", "false").lower() == "true"
    )
    ENSEMBLE_MODE: bool = os.getenv("LATENCY_ENSEMBLE_MODE", "true").lower() == "true"
    MIN_SAMPLES_FOR_ENSEMBLE_SPLIT: int = int(os.getenv("LATENCY_MIN_SAMPLES_FOR_ENSEMBLE_SPLIT", "200"))
    TPOT_ZERO_TOKEN_COUNT: bool = os.getenv("LATENCY_TPOT_ZERO_TOKEN_COUNT", "true").lower() == "true"
    ENABLE_TOKEN_IN_FLIGHT_FEATURES: bool = (
        os.getenv("LATENCY_ENABLE_TOKEN_IN_FLIGHT_FEATURES", "true").lower() == "true"
    )
    # On by default. NOTE: a model persisted before these columns existed will fail
    # on feature-count mismatch until its first retrain, so when rolling this out on
    # top of an existing deployment, flush or regenerate models (and keep this flag in
    # sync with the prediction server). Set to "false" to disable.
    ENABLE_ENCODER_FEATURES: bool = os.getenv("LATENCY_ENABLE_ENCODER_FEATURES", "true").lower() == "true"

    # Gated ensemble model paths (each wraps noqueue + queued sub-models)
    TTFT_GATED_MODEL_PATH: str = os.getenv("LATENCY_TTFT_GATED_MODEL_PATH", "/tmp/models/ttft_gated.joblib")
    TPOT_GATED_MODEL_PATH: str = os.getenv("LATENCY_TPOT_GATED_MODEL_PATH", "/tmp/models/tpot_gated.joblib")


settings = Settings()
logging.basicConfig(level=logging.INFO, format="%(asctime)s - %(levelname)s - %(message)s")


# Add this to your Pydantic models section
class ModelInfoResponse(BaseModel):
    model_type: str
    xgboost_available: bool
    lightgbm_available: bool = Field(
        default=False, description="Whether LightGBM is available"
    )  # FIXED: Added this field

    is_ready: bool
    ttft_training_samples: int = Field(default=0, description="Number of TTFT training samples")
    tpot_training_samples: int = Field(default=0, description="Number of TPOT training samples")
    ttft_test_samples: int = Field(default=0, description="Number of TTFT test samples")
    tpot_test_samples: int = Field(default=0, description="Number of TPOT test samples")
    last_retrain_time: datetime | None = Field(default=None, description="Last retraining timestamp")
    min_samples_for_retrain: int = Field(default=0, description="Minimum samples required for retraining")
    retraining_interval_sec: int = Field(default=0, description="Retraining interval in seconds")


class FlushRequest(BaseModel):
    flush_training_data: bool = Field(default=True, description="Flush training data buckets")
    flush_test_data: bool = Field(default=True, description="Flush test data")
    flush_metrics: bool = Field(default=True, description="Flush quantile metric scores")
    reason: str | None = Field(default=None, description="Optional reason for flushing")


class FlushResponse(BaseModel):
    success: bool
    flushed_at: datetime
    reason: str | None = None
    ttft_training_samples_flushed: int
    tpot_training_samples_flushed: int
    ttft_test_samples_flushed: int
    tpot_test_samples_flushed: int
    metrics_cleared: bool
    message: str


def quantile_loss(y_true, y_pred, quantile):
    """
    Calculate quantile loss (also known as pinball loss).

    For quantile τ (tau), the loss is:
    - (τ - 1) * (y_true - y_pred) if y_true < y_pred (under-prediction)
    - τ * (y_true - y_pred) if y_true >= y_pred (over-prediction)

    Args:
        y_true: actual values
        y_pred: predicted quantile values
        quantile: the quantile being predicted (e.g., 0.9 for p90)

    Returns:
        Mean quantile loss
    """
    errors = y_true - y_pred
    loss = np.where(errors >= 0, quantile * errors, (quantile - 1) * errors)
    return np.mean(loss)


def quantile_coverage(y_true, y_pred, quantile):
    """
    Calculate quantile coverage - the proportion of actual values that fall below the predicted quantile.

    For a well-calibrated p90 model, this should be close to 0.9 (90%).

    Args:
        y_true: actual values
        y_pred: predicted quantile values
        quantile: the quantile being predicted (e.g., 0.9 for p90)

    Returns:
        Coverage percentage (0-100)
    """
    below_prediction = np.sum(y_true <= y_pred)
    coverage = below_prediction / len(y_true)
    return coverage * 100


def quantile_violation_rate(y_true, y_pred, quantile):
    """
    Calculate quantile violation rate - the proportion of times actual values exceed the predicted quantile.

    For a well-calibrated p90 model, this should be close to 0.1 (10%).

    Args:
        y_true: actual values
        y_pred: predicted quantile values
        quantile: the quantile being predicted (e.g., 0.9 for p90)

    Returns:
        Violation rate percentage (0-100)
    """
    violations = np.sum(y_true > y_pred)
    violation_rate = violations / len(y_true)
    return violation_rate * 100


def _get_model_paths():
    """Canonical mapping of model names to file paths."""
    return {
        "ttft": settings.TTFT_MODEL_PATH,
        "tpot": settings.TPOT_MODEL_PATH,
        "ttft_scaler": settings.TTFT_SCALER_PATH,
        "tpot_scaler": settings.TPOT_SCALER_PATH,
        "ttft_gated": settings.TTFT_GATED_MODEL_PATH,
        "tpot_gated": settings.TPOT_GATED_MODEL_PATH,
    }


class LatencyPredictor:
    """
    Manages model training, prediction, and data handling.
    """

    def __init__(self, model_type: str = None):
        # Set model type with validation
        if model_type is None:
            model_type = settings.MODEL_TYPE

        if model_type not in [ModelType.BAYESIAN_RIDGE, ModelType.XGBOOST, ModelType.LIGHTGBM]:
            raise ValueError(f"Invalid model_type: {model_type}. Must be one of {list(ModelType)}")

        if model_type == ModelType.XGBOOST and not XGBOOST_AVAILABLE:
            logging.warning("XGBoost requested but not available. Falling back to Bayesian Ridge.")
            model_type = ModelType.BAYESIAN_RIDGE

        if model_type == ModelType.LIGHTGBM and not LIGHTGBM_AVAILABLE:
            logging.warning("LightGBM requested but not available. Falling back to Bayesian Ridge.")
            model_type = ModelType.BAYESIAN_RIDGE

        self.model_type = ModelType(model_type)
        self.quantile = settings.QUANTILE_ALPHA
        self.objective_type = settings.OBJECTIVE_TYPE
        logging.info(
            f"Initialized LatencyPredictor with model type: {self.model_type}, objective: {self.objective_type}, quantile: {self.quantile}"
        )

        # Data buckets for sampling
        self.cache_buckets = int(1.0 / 0.05)  # 20 buckets for cache percentage (0-100% in 5% increments)
        self.queue_buckets = 5  # 0, 1-2, 3-5, 6-10, 11+ waiting requests
        self.prefix_buckets = 4  # NEW: 0-25%, 25-50%, 50-75%, 75-100% prefix cache score
        self.bucket_size = settings.MAX_TRAINING_DATA_SIZE_PER_BUCKET

        # Data buckets with tuple keys: (queue_bucket, cache_bucket, prefix_bucket)
        self.ttft_data_buckets = {
            (q, c, p): deque(maxlen=self.bucket_size)
            for q in range(self.queue_buckets)
            for c in range(self.cache_buckets)
            for p in range(self.prefix_buckets)  # NEW: Added prefix dimension
        }
        self.tpot_data_buckets = {
            (q, c, p): deque(maxlen=self.bucket_size)
            for q in range(self.queue_buckets)
            for c in range(self.cache_buckets)
            for p in range(self.prefix_buckets)  # NEW: Added prefix dimension
        }

        # Test data storage with configurable max size
        self.ttft_test_data = deque(maxlen=settings.MAX_TEST_DATA_SIZE)
        self.tpot_test_data = deque(maxlen=settings.MAX_TEST_DATA_SIZE)

        # Quantile-specific metric tracking (store last 5 scores)
        self.ttft_quantile_loss_scores = deque(maxlen=5)
        self.tpot_quantile_loss_scores = deque(maxlen=5)
        self.ttft_coverage_scores = deque(maxlen=5)
        self.tpot_coverage_scores = deque(maxlen=5)
        self.ttft_violation_rates = deque(maxlen=5)
        self.tpot_violation_rates = deque(maxlen=5)

        # Mean-objective metric tracking (store last 5 scores)
        self.ttft_mae_scores = deque(maxlen=5)
        self.tpot_mae_scores = deque(maxlen=5)
        self.ttft_rmse_scores = deque(maxlen=5)
        self.tpot_rmse_scores = deque(maxlen=5)

        self.ttft_model = None
        self.tpot_model = None
        self.ttft_scaler = None
        self.tpot_scaler = None

        self.ttft_coefficients = None  # Will store descaled coefficients as dict
        self.tpot_coefficients = None  # Will store descaled coefficients as dict

        # Gated ensemble model wrappers (QueueGatedModel instances)
        self.ttft_gated: QueueGatedModel | None = None
        self.tpot_gated: QueueGatedModel | None = None
        self.ensemble_active: bool = False

        self.lock = threading.Lock()
        self.last_retrain_time = None
        self._shutdown_event = threading.Event()
        self._training_thread: threading.Thread = None

    def _get_prefix_bucket(self, prefix_score: float) -> int:
        """Map prefix cache score to bucket index."""
        score = max(0.0, min(1.0, prefix_score))
        return min(int(score * self.prefix_buckets), self.prefix_buckets - 1)

    def _get_queue_bucket(self, num_waiting: int) -> int:
        """Map number of waiting requests to queue bucket index."""
        if num_waiting == 0:
            return 0
        elif num_waiting <= 2:
            return 1
        elif num_waiting <= 5:
            return 2
        elif num_waiting <= 10:
            return 3
        else:
            return 4  # 11+ requests

    def _get_cache_bucket(self, cache_percentage: float) -> int:
        """Map cache percentage to cache bucket index."""
        pct = max(0.0, min(1.0, cache_percentage))
        return min(int(pct * self.cache_buckets), self.cache_buckets - 1)

    def _get_bucket_key(self, sample: dict) -> tuple:
        """Get (queue_bucket, cache_bucket) tuple key for a sample."""
        queue_bucket = self._get_queue_bucket(sample["num_request_waiting"])
        cache_bucket = self._get_cache_bucket(sample["kv_cache_percentage"])
        prefix_bucket = self._get_prefix_bucket(sample["prefix_cache_score"])  # NEW

        return (queue_bucket, cache_bucket, prefix_bucket)

    def _split_samples_by_queue(self, buckets: dict) -> tuple[list, list]:
        """Split bucket samples into noqueue (queue_bucket==0) and queued (queue_bucket>=1).

        Returns:
            (noqueue_samples, queued_samples)
        """
        noqueue_samples = []
        queued_samples = []
        for (queue_bucket, _cache_bucket, _prefix_bucket), bucket_deque in buckets.items():
            if queue_bucket == 0:
                noqueue_samples.extend(bucket_deque)
            else:
                queued_samples.extend(bucket_deque)
        return noqueue_samples, queued_samples

    def _prepare_features_for_ensemble(self, df: pd.DataFrame, model_type: str, queue_regime: str) -> pd.DataFrame:
        """Prepare features for ensemble sub-models.

        Args:
            df: DataFrame with raw features
            model_type: 'ttft' or 'tpot'
            queue_regime: 'noqueue' or 'queued'
        Returns:
            DataFrame with engineered features, with queue columns dropped for noqueue regime
        """
        features = self._prepare_features_with_interaction(df, model_type)
        if queue_regime == "noqueue":
            features = features.drop(columns=["is_queued", "num_request_waiting"], errors="ignore")
        return features

    def _store_descaled_coefficients(self, model, scaler, feature_names, model_name):
        """
        Store descaled coefficients for Bayesian Ridge models.
        Returns a dict with feature names as keys and coefficients as values.
        """
        if self.model_type != ModelType.BAYESIAN_RIDGE or model is None or scaler is None:
            return None

        try:
            # Get scaled coefficients and scaler parameters
            coef_scaled = model.coef_
            scale, mean = scaler.scale_, scaler.mean_

            # Descale coefficients: w_original = w_scaled / scale
            w_orig = coef_scaled / scale

            # Calculate descaled intercept: b_orig = b_scaled - sum(w_scaled * mean / scale)
            intercept = float(model.intercept_) - float(np.dot(coef_scaled, mean / scale))

            # Create coefficient dictionary
            coefficients = {"intercept": intercept}
            for feature, coef in zip(feature_names, w_orig):
                coefficients[feature] = float(coef)

            logging.info(f"Stored descaled coefficients for {model_name}: {coefficients}")
            return coefficients

        except Exception as e:
            logging.error(f"Error storing descaled coefficients for {model_name}: {e}")
            return None

    def _prepare_features_with_interaction(self, df: pd.DataFrame, model_type: str) -> pd.DataFrame:
        """
        Prepare features with interaction terms for better model learning.
        Args:
            df: DataFrame with raw features
            model_type: 'ttft' or 'tpot'
        Returns:
            DataFrame with engineered features including interactions
        """
        # Encode pod_type as categorical (common for both TTFT and TPOT)
        # Convert to categorical with known categories for consistent encoding
        if "pod_type" in df.columns:
            df["pod_type"] = df["pod_type"].fillna("")  # Handle NaN
            df["pod_type_cat"] = pd.Categorical(
                df["pod_type"],
                categories=["", "prefill", "decode"],  # '' = monolithic, prefill, decode
                ordered=False,
            )
        else:
            # If pod_type column doesn't exist, create it as empty (monolithic)
            df["pod_type_cat"] = pd.Categorical([""] * len(df), categories=["", "prefill", "decode"], ordered=False)

        # Binary feature: gives the tree a clean signal to partition idle vs queued
        df["is_queued"] = (df["num_request_waiting"] > 0).astype(int)

        # Token-in-flight columns: populate if present/enabled, else zero-fill for safety
        tif_cols = []
        if settings.ENABLE_TOKEN_IN_FLIGHT_FEATURES:
            if "prefill_tokens_in_flight" not in df.columns:
                df["prefill_tokens_in_flight"] = 0
            if "decode_tokens_in_flight" not in df.columns:
                df["decode_tokens_in_flight"] = 0
            tif_cols = ["prefill_tokens_in_flight", "decode_tokens_in_flight"]

        if model_type == "ttft":
            # Encoder columns (multimodal, TTFT-only): populate if present/enabled,
            # else zero-fill for safety. Gated so old models without these columns
            # keep predicting until their first retrain.
            enc_cols = []
            if settings.ENABLE_ENCODER_FEATURES:
                for col in ("encoder_matched_size", "encoder_input_size"):
                    if col not in df.columns:
                        df[col] = 0
                enc_cols = ["encoder_matched_size", "encoder_input_size"]

            # Create interaction: prefix score * input length
            # This captures that prefix caching benefit scales with input size
            df["effective_input_tokens"] = (1 - df["prefix_cache_score"]) * (df["input_token_length"])
            df["prefill_score_bucket"] = (
                (df["prefix_cache_score"].clip(0, 1) * self.prefix_buckets)
                .astype(int)
                .clip(upper=self.prefix_buckets - 1)
            )

            # make it categorical for tree models (safe for LGB, XGB with enable_categorical)
            df["prefill_score_bucket"] = pd.Categorical(
                df["prefill_score_bucket"], categories=[0, 1, 2, 3], ordered=True
            )

            feature_cols = (
                ["is_queued", "kv_cache_percentage", "input_token_length", "num_request_waiting", "num_request_running"]
                + tif_cols
                + enc_cols
                + ["prefix_cache_score", "effective_input_tokens", "prefill_score_bucket", "pod_type_cat"]
            )
            return df[feature_cols]
        else:  # tpot
            feature_cols = (
                ["is_queued", "kv_cache_percentage", "input_token_length", "num_request_waiting", "num_request_running"]
                + tif_cols
                + ["num_tokens_generated", "pod_type_cat"]
            )
            return df[feature_cols]

    def shutdown(self):
        """Signal the training thread to exit and join it."""
        self._shutdown_event.set()
        if self._training_thread is not None:
            self._training_thread.join()

    @property
    def is_ready(self) -> bool:
        """Checks if all models and scalers are loaded/trained."""
        if self.model_type == ModelType.BAYESIAN_RIDGE:
            return all([self.ttft_model, self.tpot_model, self.ttft_scaler, self.tpot_scaler])
        else:  # XGBoost or LightGBM
            return all([self.ttft_model, self.tpot_model])

    @is_ready.setter
    def is_ready(self, value: bool):
        if not isinstance(value, bool):
            raise ValueError("is_ready must be a boolean value.")
        self._is_ready_override = value

    def _all_samples(self, buckets: dict) -> list:
        samples = []
        for bucket_deque in buckets.values():
            samples.extend(bucket_deque)
        return samples

    def _train_model_with_scaling(
        self,
        features: pd.DataFrame,
        target: pd.Series,
        model_name: str = None,
        sample_weight: np.ndarray = None,
        drop_queue_features: bool = False,
    ) -> tuple[BayesianRidge, StandardScaler] | (xgb.XGBRegressor | lgb.LGBMRegressor):
        try:
            if len(features) == 0 or len(target) == 0:
                raise ValueError("Empty training data")
            if features.isnull().any().any() or target.isnull().any():
                raise ValueError("Training data contains NaN values")
            # Check only numeric columns for infinity (categorical columns cause isinf to fail)
            numeric_features = features.select_dtypes(include=[np.number])
            if len(numeric_features.columns) > 0 and np.isinf(numeric_features.values).any():
                raise ValueError("Training data contains infinite values")
            if np.isinf(target.values).any():
                raise ValueError("Target data contains infinite values")

            if self.model_type == ModelType.BAYESIAN_RIDGE:
                # Bayesian Ridge can't handle categorical features directly
                # Drop categorical bucket, but one-hot encode pod_type to preserve the information
                features = features.drop(columns=["prefill_score_bucket"], errors="ignore")

                # One-hot encode pod_type_cat if it exists (converts to numeric 0/1 columns)
                if "pod_type_cat" in features.columns:
                    features = pd.get_dummies(features, columns=["pod_type_cat"], prefix="pod_type", drop_first=False)

                scaler = StandardScaler()
                features_scaled = scaler.fit_transform(features)
                if np.isnan(features_scaled).any() or np.isinf(features_scaled).any():
                    raise ValueError("Scaling produced invalid values")

                # For Bayesian Ridge, we'll approximate quantile regression by training on the mean
                # but adjusting predictions later. This is not ideal but Bayesian Ridge doesn't
                # natively support quantile regression.
                model = BayesianRidge(compute_score=True)
                model.fit(features_scaled, target, sample_weight=sample_weight)
                return model, scaler

            elif self.model_type == ModelType.XGBOOST:  # XGBoost with quantile regression
                if model_name == "ttft":
                    # enforce your TTFT feature order (including pod_type_cat)
                    _tif = (
                        ["prefill_tokens_in_flight", "decode_tokens_in_flight"]
                        if settings.ENABLE_TOKEN_IN_FLIGHT_FEATURES
                        else []
                    )
                    _enc = ["encoder_matched_size", "encoder_input_size"] if settings.ENABLE_ENCODER_FEATURES else []
                    if drop_queue_features:
                        ttft_order = (
                            ["kv_cache_percentage", "input_token_length", "num_request_running"]
                            + _tif
                            + _enc
                            + ["prefix_cache_score", "effective_input_tokens", "prefill_score_bucket", "pod_type_cat"]
                        )
                    else:
                        ttft_order = (
                            [
                                "is_queued",
                                "kv_cache_percentage",
                                "input_token_length",
                                "num_request_waiting",
                                "num_request_running",
                            ]
                            + _tif
                            + _enc
                            + ["prefix_cache_score", "effective_input_tokens", "prefill_score_bucket", "pod_type_cat"]
                        )
                    if list(features.columns) != ttft_order:
                        try:
                            features = features[ttft_order]
                        except Exception:
                            raise ValueError(
                                f"TTFT features must be exactly {ttft_order}; got {list(features.columns)}"
                            )

                    # ---- (A) Build a warm-start stump that must split on prefill_score_bucket ----
                    # Train on the SAME full feature set, but freeze all other features to constants,
                    # so the only useful split is the prefix bucket.
                    features_stump = features.copy()
                    for col in features_stump.columns:
                        if col != "prefill_score_bucket":
                            # keep dtype, set to a constant scalar
                            const_val = features_stump[col].iloc[0]
                            features_stump[col] = const_val

                    # ensure prefill bucket is int codes if it's categorical
                    if str(features_stump["prefill_score_bucket"].dtype) == "category":
                        features_stump["prefill_score_bucket"] = features_stump[
                            "prefill_score_bucket"
                        ].cat.codes.astype("int32")
                    else:
                        features_stump["prefill_score_bucket"] = features_stump["prefill_score_bucket"].astype("int32")

                    xgb_params = {
                        "n_estimators": 200,  # Number of trees to build (moderate value for balanced accuracy and speed)
                        "max_depth": 6,  # Depth of trees; 6 is typically a sweet spot balancing bias/variance
                        "learning_rate": 0.05,  # Smaller learning rate to achieve stable convergence
                        "subsample": 0.8,  # Use 80% of data per tree (adds regularization & reduces overfitting)
                        "colsample_bytree": 0.8,  # Use 80% of features per tree (improves generalization)
                        # Key parameters for accurate regression:
                        "min_child_weight": 5,  # Low value allows fine-grained splits near boundary (prevents overprediction)
                        "gamma": 0.2,  # Low gamma allows splits with small loss reduction (critical for quantile accuracy)
                        # Regularization to prevent overfitting:
                        "reg_alpha": 0.01,  # L1 regularization (Lasso) - encourages sparsity
                        "reg_lambda": 0.1,  # L2 regularization (Ridge) - prevents large coefficients
                        # Performance optimization:
                        "tree_method": "hist",  # Efficient histogram algorithm; optimal for large datasets
                        "n_jobs": -1,  # Utilize all CPU cores for parallel training
                        "random_state": 42,  # Ensures reproducible results
                        "verbosity": 1,
                        "enable_categorical": True,  # Enable categorical feature support
                    }
                    if self.objective_type == ObjectiveType.MEAN:
                        xgb_params["objective"] = "reg:squarederror"
                    else:
                        xgb_params["objective"] = "reg:quantileerror"
                        xgb_params["quantile_alpha"] = self.quantile
                    model = xgb.XGBRegressor(**xgb_params)
                    model.fit(features, target, sample_weight=sample_weight)
                    return model

                elif model_name == "tpot":
                    _tif = (
                        ["prefill_tokens_in_flight", "decode_tokens_in_flight"]
                        if settings.ENABLE_TOKEN_IN_FLIGHT_FEATURES
                        else []
                    )
                    if drop_queue_features:
                        tpot_order = (
                            ["kv_cache_percentage", "input_token_length", "num_request_running"]
                            + _tif
                            + ["num_tokens_generated", "pod_type_cat"]
                        )
                    else:
                        tpot_order = (
                            [
                                "is_queued",
                                "kv_cache_percentage",
                                "input_token_length",
                                "num_request_waiting",
                                "num_request_running",
                            ]
                            + _tif
                            + ["num_tokens_generated", "pod_type_cat"]
                        )
                    if list(features.columns) != tpot_order:
                        try:
                            features = features[tpot_order]
                        except Exception as _:
                            raise ValueError(
                                f"TPOT features must be exactly {tpot_order}; got {list(features.columns)}"
                            )
                xgb_params = {
                    "n_estimators": 200,  # Number of trees to build (moderate value for balanced accuracy and speed)
                    "max_depth": 6,  # Depth of trees; 6 is typically a sweet spot balancing bias/variance
                    "learning_rate": 0.05,  # Smaller learning rate to achieve stable convergence
                    "subsample": 0.8,  # Use 80% of data per tree (adds regularization & reduces overfitting)
                    "colsample_bytree": 0.8,  # Use 80% of features per tree (improves generalization)
                    # Key parameters for accurate regression:
                    "min_child_weight": 5,  # Low value allows fine-grained splits near boundary (prevents overprediction)
                    "gamma": 0.2,  # Low gamma allows splits with small loss reduction (critical for quantile accuracy)
                    # Regularization to prevent overfitting:
                    "reg_alpha": 0.01,  # L1 regularization (Lasso) - encourages sparsity
                    "reg_lambda": 0.1,  # L2 regularization (Ridge) - prevents large coefficients
                    # Performance optimization:
                    "tree_method": "hist",  # Efficient histogram algorithm; optimal for large datasets
                    "n_jobs": -1,  # Utilize all CPU cores for parallel training
                    "random_state": 42,  # Ensures reproducible results
                    "verbosity": 1,
                    "enable_categorical": True,  # Enable categorical feature support
                }
                if self.objective_type == ObjectiveType.MEAN:
                    xgb_params["objective"] = "reg:squarederror"
                else:
                    xgb_params["objective"] = "reg:quantileerror"
                    xgb_params["quantile_alpha"] = self.quantile
                model = xgb.XGBRegressor(**xgb_params)
                model.fit(features, target, sample_weight=sample_weight)
                return model
            elif self.model_type == ModelType.LIGHTGBM:
                lgb_params = {
                    "n_estimators": 200,
                    "max_depth": 6,
                    "learning_rate": 0.05,
                    "subsample": 0.8,
                    "colsample_bytree": 0.8,
                    "min_child_samples": 20,
                    "reg_alpha": 0.1,
                    "reg_lambda": 0.1,
                    "n_jobs": -1,
                    "random_state": 42,
                    "verbosity": -1,
                    "force_col_wise": True,
                }
                if self.objective_type == ObjectiveType.MEAN:
                    lgb_params["objective"] = "regression"
                else:
                    lgb_params["objective"] = "quantile"
                    lgb_params["alpha"] = self.quantile
                model = lgb.LGBMRegressor(**lgb_params)
                model.fit(
                    features,
                    target,
                    sample_weight=sample_weight,
                    categorical_feature=["prefill_score_bucket"] if model_name == "ttft" else None,
                )
                return model

        except Exception as e:
            logging.error(f"Error in _train_model_with_scaling: {e}", exc_info=True)
            raise

    def _calculate_metrics_on_test(self, model, scaler, test_data, model_name, target_col):
        """Calculate metrics on test data.

        For quantile objective: returns (quantile_loss, coverage, violation_rate).
        For mean objective: returns (mae, rmse, None).
        Returns (None, None, None) on failure.
        """
        try:
            clean_metrics = self._drop_timestamp(test_data)
            df_raw = pd.DataFrame(clean_metrics).dropna()
            df_raw = df_raw[df_raw[target_col] > 0]

            if len(df_raw) < 2:
                return None, None, None

            df_features = self._prepare_features_with_interaction(df_raw.copy(), model_type=model_name)

            _tif = (
                ["prefill_tokens_in_flight", "decode_tokens_in_flight"]
                if settings.ENABLE_TOKEN_IN_FLIGHT_FEATURES
                else []
            )
            if model_name == "ttft":
                _enc = ["encoder_matched_size", "encoder_input_size"] if settings.ENABLE_ENCODER_FEATURES else []
                if self.model_type == ModelType.BAYESIAN_RIDGE:
                    feature_cols = (
                        [
                            "is_queued",
                            "kv_cache_percentage",
                            "input_token_length",
                            "num_request_waiting",
                            "num_request_running",
                        ]
                        + _tif
                        + _enc
                        + ["prefix_cache_score", "effective_input_tokens", "pod_type_cat"]
                    )
                else:
                    feature_cols = (
                        [
                            "is_queued",
                            "kv_cache_percentage",
                            "input_token_length",
                            "num_request_waiting",
                            "num_request_running",
                        ]
                        + _tif
                        + _enc
                        + ["prefix_cache_score", "effective_input_tokens", "prefill_score_bucket", "pod_type_cat"]
                    )
            else:
                feature_cols = (
                    [
                        "is_queued",
                        "kv_cache_percentage",
                        "input_token_length",
                        "num_request_waiting",
                        "num_request_running",
                    ]
                    + _tif
                    + ["num_tokens_generated", "pod_type_cat"]
                )

            X = df_features[feature_cols]

            if self.model_type == ModelType.BAYESIAN_RIDGE and scaler is not None:
                if "pod_type_cat" in X.columns:
                    X = pd.get_dummies(X, columns=["pod_type_cat"], prefix="pod_type", drop_first=False)
                X = scaler.transform(X)

            y_true = df_raw[target_col].values
            y_pred = model.predict(X)

            if self.objective_type == ObjectiveType.MEAN:
                mae = float(np.mean(np.abs(y_true - y_pred)))
                rmse = float(np.sqrt(np.mean((y_true - y_pred) ** 2)))
                return mae, rmse, None

            # Quantile objective
            if self.model_type == ModelType.BAYESIAN_RIDGE:
                std_factor = norm.ppf(self.quantile)
                _, y_std = model.predict(X, return_std=True)
                y_pred = y_pred + std_factor * y_std

            ql = quantile_loss(y_true, y_pred, self.quantile)
            coverage = quantile_coverage(y_true, y_pred, self.quantile)
            violation_rate = quantile_violation_rate(y_true, y_pred, self.quantile)
            return ql, coverage, violation_rate

        except Exception as e:
            logging.error(f"Error calculating metrics: {e}", exc_info=True)
            return None, None, None

    def _create_default_model(self, model_type: str) -> tuple[BayesianRidge, StandardScaler] | (
        xgb.XGBRegressor | lgb.LGBMRegressor
    ):
        """Creates and trains a simple default model with initial priors."""
        try:
            logging.info(f"Creating default '{model_type}' model with priors.")
            if model_type == "ttft":
                features = pd.DataFrame(
                    {
                        "kv_cache_percentage": [0.0],
                        "input_token_length": [1],
                        "num_request_waiting": [0],
                        "num_request_running": [0],
                        "prefill_tokens_in_flight": [0],
                        "decode_tokens_in_flight": [0],
                        "encoder_matched_size": [0],
                        "encoder_input_size": [0],
                        "prefix_cache_score": [0.0],
                    }
                )
                features = self._prepare_features_with_interaction(features, "ttft")
                target = pd.Series([10.0])

            else:
                features = pd.DataFrame(
                    {
                        "kv_cache_percentage": [0.0],
                        "input_token_length": [1],
                        "num_request_waiting": [0],
                        "num_request_running": [0],
                        "prefill_tokens_in_flight": [0],
                        "decode_tokens_in_flight": [0],
                        "num_tokens_generated": [1],
                    }
                )
                features = self._prepare_features_with_interaction(features, "tpot")
                target = pd.Series([10.0])
            return self._train_model_with_scaling(features, target, model_name=model_type)
        except Exception as e:
            logging.error(f"Error creating default model for {model_type}: {e}", exc_info=True)
            raise

    def train(self):
        try:
            with self.lock:
                ttft_snap = list(self._all_samples(self.ttft_data_buckets))
                tpot_snap = list(self._all_samples(self.tpot_data_buckets))
                total = len(ttft_snap) + len(tpot_snap)
                if total < settings.MIN_SAMPLES_FOR_RETRAIN:
                    logging.info(f"Skipping training: only {total} samples (< {settings.MIN_SAMPLES_FOR_RETRAIN}).")
                    return
                logging.info(
                    f"Initiating training with {total} samples using {self.model_type} for quantile {self.quantile}."
                )

            new_ttft_model = new_ttft_scaler = None
            new_tpot_model = new_tpot_scaler = None

            # Train TTFT
            if ttft_snap:
                clean_ttft = self._drop_timestamp(ttft_snap)
                raw_ttft = pd.DataFrame(clean_ttft).dropna()
                raw_ttft = raw_ttft[raw_ttft["actual_ttft_ms"] > 0]
                df_ttft = self._prepare_features_with_interaction(raw_ttft.copy(), model_type="ttft")
                print(f"TTFT training data size: {len(df_ttft)} with sample data: {df_ttft.columns.tolist()}")
                if len(df_ttft) >= settings.MIN_SAMPLES_FOR_RETRAIN:
                    # Updated TTFT features to include prefix_cache_score and pod_type_cat
                    _tif = (
                        ["prefill_tokens_in_flight", "decode_tokens_in_flight"]
                        if settings.ENABLE_TOKEN_IN_FLIGHT_FEATURES
                        else []
                    )
                    _enc = ["encoder_matched_size", "encoder_input_size"] if settings.ENABLE_ENCODER_FEATURES else []
                    ttft_feature_cols_tree = (
                        [
                            "is_queued",
                            "kv_cache_percentage",
                            "input_token_length",
                            "num_request_waiting",
                            "num_request_running",
                        ]
                        + _tif
                        + _enc
                        + ["prefix_cache_score", "effective_input_tokens", "prefill_score_bucket", "pod_type_cat"]
                    )
                    ttft_feature_cols_br = (
                        [
                            "is_queued",
                            "kv_cache_percentage",
                            "input_token_length",
                            "num_request_waiting",
                            "num_request_running",
                        ]
                        + _tif
                        + _enc
                        + ["prefix_cache_score", "effective_input_tokens"]
                    )

                    # Build X_ttft for all model types, then trim for BR
                    X_ttft = df_ttft[ttft_feature_cols_tree]
                    if self.model_type == ModelType.BAYESIAN_RIDGE:
                        # For Bayesian Ridge, drop categorical features (handled by one-hot encoding in _train_model_with_scaling)
                        X_ttft = df_ttft  # Use full df_ttft which will be processed by _train_model_with_scaling

                    y_ttft = raw_ttft["actual_ttft_ms"]

                    try:
                        # raw_ttft still has the original columns including 'prefix_cache_score'
                        raw_ttft["_prefix_bucket"] = (
                            raw_ttft["prefix_cache_score"]
                            .clip(0, 1)
                            .apply(lambda s: min(int(s * self.prefix_buckets), self.prefix_buckets - 1))
                        )

                        bucket_counts = raw_ttft["_prefix_bucket"].value_counts().to_dict()
                        total_ttft = len(raw_ttft)
                        num_buckets = max(1, len(bucket_counts))
                        epsilon = 1.0
                        bucket_weights = {
                            p: total_ttft / (num_buckets * (cnt + epsilon)) for p, cnt in bucket_counts.items()
                        }
                        sample_weight_ttft = None
                        if settings.SAMPLE_WEIGHTING_FOR_PREFIX_CACHE:
                            sample_weight_ttft = raw_ttft["_prefix_bucket"].map(bucket_weights).astype(float).to_numpy()
                            sample_weight_ttft *= len(sample_weight_ttft) / sample_weight_ttft.sum()

                        result = self._train_model_with_scaling(
                            X_ttft, y_ttft, model_name="ttft", sample_weight=sample_weight_ttft
                        )
                        if self.model_type == ModelType.BAYESIAN_RIDGE:
                            new_ttft_model, new_ttft_scaler = result
                        else:
                            new_ttft_model = result
                            new_ttft_scaler = None

                        # Evaluate on test set
                        m1 = m2 = m3 = None
                        if self.ttft_test_data:
                            m1, m2, m3 = self._calculate_metrics_on_test(
                                new_ttft_model, new_ttft_scaler, list(self.ttft_test_data), "ttft", "actual_ttft_ms"
                            )

                        if m1 is not None:
                            if self.objective_type == ObjectiveType.MEAN:
                                self.ttft_mae_scores.append(m1)
                                self.ttft_rmse_scores.append(m2)
                                logging.info(
                                    f"TTFT model trained on {len(df_ttft)} samples. MAE = {m1:.4f}, RMSE = {m2:.4f}"
                                )
                            else:
                                self.ttft_quantile_loss_scores.append(m1)
                                self.ttft_coverage_scores.append(m2)
                                self.ttft_violation_rates.append(m3)
                                logging.info(
                                    f"TTFT model trained on {len(df_ttft)} samples. "
                                    f"Quantile Loss = {m1:.4f}, "
                                    f"Coverage = {m2:.2f}% (target: {self.quantile * 100:.0f}%), "
                                    f"Violation Rate = {m3:.2f}% (target: {(1 - self.quantile) * 100:.0f}%)"
                                )
                        else:
                            logging.info(
                                f"TTFT model trained on {len(df_ttft)} samples. Metrics = N/A (insufficient test data)"
                            )

                    except Exception:
                        logging.error("Error training TTFT model", exc_info=True)

            # Train TPOT
            if tpot_snap:
                clean_tpot = self._drop_timestamp(tpot_snap)
                df_tpot = pd.DataFrame(clean_tpot).dropna()
                df_tpot = df_tpot[df_tpot["actual_tpot_ms"] > 0]
                if settings.TPOT_ZERO_TOKEN_COUNT:
                    df_tpot["num_tokens_generated"] = 0
                if len(df_tpot) >= settings.MIN_SAMPLES_FOR_RETRAIN:
                    # TPOT features - use feature preparation to add pod_type_cat
                    X_tpot = self._prepare_features_with_interaction(df_tpot.copy(), model_type="tpot")
                    y_tpot = df_tpot["actual_tpot_ms"]
                    try:
                        result = self._train_model_with_scaling(X_tpot, y_tpot, model_name="tpot")
                        if self.model_type == ModelType.BAYESIAN_RIDGE:
                            new_tpot_model, new_tpot_scaler = result
                        else:
                            new_tpot_model = result
                            new_tpot_scaler = None

                        # Evaluate on test set
                        m1, m2, m3 = self._calculate_metrics_on_test(
                            new_tpot_model, new_tpot_scaler, list(self.tpot_test_data), "tpot", "actual_tpot_ms"
                        )

                        if m1 is not None:
                            if self.objective_type == ObjectiveType.MEAN:
                                self.tpot_mae_scores.append(m1)
                                self.tpot_rmse_scores.append(m2)
                                logging.info(
                                    f"TPOT model trained on {len(df_tpot)} samples. MAE = {m1:.4f}, RMSE = {m2:.4f}"
                                )
                            else:
                                self.tpot_quantile_loss_scores.append(m1)
                                self.tpot_coverage_scores.append(m2)
                                self.tpot_violation_rates.append(m3)
                                logging.info(
                                    f"TPOT model trained on {len(df_tpot)} samples. "
                                    f"Quantile Loss = {m1:.4f}, "
                                    f"Coverage = {m2:.2f}% (target: {self.quantile * 100:.0f}%), "
                                    f"Violation Rate = {m3:.2f}% (target: {(1 - self.quantile) * 100:.0f}%)"
                                )
                        else:
                            logging.info(
                                f"TPOT model trained on {len(df_tpot)} samples. Metrics = N/A (insufficient test data)"
                            )

                    except Exception:
                        logging.error("Error training TPOT model", exc_info=True)
                else:
                    logging.warning("Not enough TPOT samples, skipping TPOT training.")

            # --- Ensemble (gated) training ---
            new_ttft_gated = None
            new_tpot_gated = None

            if settings.ENSEMBLE_MODE:
                try:
                    with self.lock:
                        ttft_noqueue, ttft_queued = self._split_samples_by_queue(self.ttft_data_buckets)
                        tpot_noqueue, tpot_queued = self._split_samples_by_queue(self.tpot_data_buckets)

                    min_split = settings.MIN_SAMPLES_FOR_ENSEMBLE_SPLIT
                    split_counts = {
                        "ttft_noqueue": len(ttft_noqueue),
                        "ttft_queued": len(ttft_queued),
                        "tpot_noqueue": len(tpot_noqueue),
                        "tpot_queued": len(tpot_queued),
                    }
                    logging.info(f"Ensemble split counts: {split_counts}, min required: {min_split}")

                    if all(cnt >= min_split for cnt in split_counts.values()):
                        sub_models = {}  # key -> (model, scaler_or_None)

                        for key, samples, model_name, target_col, regime in [
                            ("ttft_noqueue", ttft_noqueue, "ttft", "actual_ttft_ms", "noqueue"),
                            ("ttft_queued", ttft_queued, "ttft", "actual_ttft_ms", "queued"),
                            ("tpot_noqueue", tpot_noqueue, "tpot", "actual_tpot_ms", "noqueue"),
                            ("tpot_queued", tpot_queued, "tpot", "actual_tpot_ms", "queued"),
                        ]:
                            try:
                                clean = self._drop_timestamp(samples)
                                raw = pd.DataFrame(clean).dropna()
                                raw = raw[raw[target_col] > 0]
                                X = self._prepare_features_for_ensemble(raw.copy(), model_name, regime)
                                y = raw[target_col]
                                drop_q = regime == "noqueue"
                                result = self._train_model_with_scaling(
                                    X, y, model_name=model_name, drop_queue_features=drop_q
                                )
                                if self.model_type == ModelType.BAYESIAN_RIDGE:
                                    sub_models[key] = result  # (model, scaler)
                                else:
                                    sub_models[key] = (result, None)
                                logging.info(f"{key} model trained on {len(raw)} samples")
                            except Exception:
                                logging.error(f"Error training {key} model", exc_info=True)

                        # Build gated wrappers only if all 4 sub-models trained
                        if len(sub_models) == 4:
                            new_ttft_gated = QueueGatedModel(
                                noqueue_model=sub_models["ttft_noqueue"][0],
                                queued_model=sub_models["ttft_queued"][0],
                                noqueue_scaler=sub_models["ttft_noqueue"][1],
                                queued_scaler=sub_models["ttft_queued"][1],
                            )
                            new_tpot_gated = QueueGatedModel(
                                noqueue_model=sub_models["tpot_noqueue"][0],
                                queued_model=sub_models["tpot_queued"][0],
                                noqueue_scaler=sub_models["tpot_noqueue"][1],
                                queued_scaler=sub_models["tpot_queued"][1],
                            )
                            logging.info("Ensemble training succeeded — built QueueGatedModel wrappers")
                        else:
                            logging.warning(
                                "Ensemble training failed for some sub-models, falling back to single model"
                            )
                    else:
                        logging.info("Insufficient samples for ensemble split, using single model only")
                except Exception:
                    logging.error("Error in ensemble training block", exc_info=True)

            with self.lock:
                if new_ttft_model:
                    self.ttft_model = new_ttft_model
                    if new_ttft_scaler is not None:
                        self.ttft_scaler = new_ttft_scaler

                    # Store descaled coefficients for Bayesian Ridge
                    if self.model_type == ModelType.BAYESIAN_RIDGE:
                        ttft_features = ttft_feature_cols_br  # no 'prefill_score_bucket' for BR
                        self.ttft_coefficients = self._store_descaled_coefficients(
                            new_ttft_model, new_ttft_scaler, ttft_features, "TTFT"
                        )

                if new_tpot_model:
                    self.tpot_model = new_tpot_model
                    if new_tpot_scaler is not None:
                        self.tpot_scaler = new_tpot_scaler

                    # Store descaled coefficients for Bayesian Ridge
                    if self.model_type == ModelType.BAYESIAN_RIDGE:
                        tpot_features = [
                            "kv_cache_percentage",
                            "input_token_length",
                            "num_request_waiting",
                            "num_request_running",
                            "num_tokens_generated",
                        ]
                        self.tpot_coefficients = self._store_descaled_coefficients(
                            new_tpot_model, new_tpot_scaler, tpot_features, "TPOT"
                        )

                # Update gated ensemble models
                if new_ttft_gated and new_tpot_gated:
                    self.ttft_gated = new_ttft_gated
                    self.tpot_gated = new_tpot_gated
                    self.ensemble_active = True
                else:
                    self.ensemble_active = False

                if self.is_ready:
                    self.last_retrain_time = datetime.now(UTC)
                    try:
                        self._save_models_unlocked()
                    except Exception:
                        logging.error("Error saving models after training.", exc_info=True)
        except Exception as e:
            logging.error(f"Critical error in train(): {e}", exc_info=True)

    def predict(self, features: dict) -> tuple[float, float, float, float]:
        try:
            with self.lock:
                if not self.is_ready:
                    raise HTTPException(status_code=503, detail="Models not ready")
                required = [
                    "kv_cache_percentage",
                    "input_token_length",
                    "num_request_waiting",
                    "num_request_running",
                    "num_tokens_generated",
                    "prefix_cache_score",
                ]
                for f in required:
                    if f not in features:
                        raise ValueError(f"Missing required feature: {f}")
                    if not isinstance(features[f], int | float):
                        raise ValueError(f"Invalid type for feature {f}: expected number")
                features.setdefault("prefill_tokens_in_flight", 0)
                features.setdefault("decode_tokens_in_flight", 0)
                features.setdefault("encoder_matched_size", 0)
                features.setdefault("encoder_input_size", 0)

                ttft_cols = [
                    "kv_cache_percentage",
                    "input_token_length",
                    "num_request_waiting",
                    "num_request_running",
                    "prefill_tokens_in_flight",
                    "decode_tokens_in_flight",
                    "encoder_matched_size",
                    "encoder_input_size",
                    "prefix_cache_score",
                ]
                tpot_cols = [
                    "kv_cache_percentage",
                    "input_token_length",
                    "num_request_waiting",
                    "num_request_running",
                    "prefill_tokens_in_flight",
                    "decode_tokens_in_flight",
                    "num_tokens_generated",
                ]
                # Create DataFrames for predictions
                df_ttft = pd.DataFrame([{col: features[col] for col in ttft_cols}])
                # Add pod_type if present (otherwise _prepare_features_with_interaction will default to '')
                if "pod_type" in features:
                    df_ttft["pod_type"] = features["pod_type"]
                # Add interaction term for TTFT (includes pod_type encoding)
                df_ttft = self._prepare_features_with_interaction(df_ttft, model_type="ttft")

                df_tpot = pd.DataFrame([{col: features[col] for col in tpot_cols}])
                # Add pod_type if present
                if "pod_type" in features:
                    df_tpot["pod_type"] = features["pod_type"]
                # Add pod_type encoding for TPOT
                df_tpot = self._prepare_features_with_interaction(df_tpot, model_type="tpot")

                if self.model_type == ModelType.BAYESIAN_RIDGE:
                    # Use scaling for Bayesian Ridge - drop categorical bucket, one-hot encode pod_type
                    df_ttft = df_ttft.drop(columns=["prefill_score_bucket"], errors="ignore")
                    if "pod_type_cat" in df_ttft.columns:
                        df_ttft = pd.get_dummies(df_ttft, columns=["pod_type_cat"], prefix="pod_type", drop_first=False)
                    ttft_scaled = self.ttft_scaler.transform(df_ttft)

                    if "pod_type_cat" in df_tpot.columns:
                        df_tpot = pd.get_dummies(df_tpot, columns=["pod_type_cat"], prefix="pod_type", drop_first=False)
                    tpot_scaled = self.tpot_scaler.transform(df_tpot)

                    ttft_pred_mean, ttft_std = self.ttft_model.predict(ttft_scaled, return_std=True)
                    tpot_pred_mean, tpot_std = self.tpot_model.predict(tpot_scaled, return_std=True)

                    if self.objective_type == ObjectiveType.MEAN:
                        return ttft_pred_mean[0], tpot_pred_mean[0], ttft_std[0], tpot_std[0]

                    std_factor = norm.ppf(self.quantile)
                    ttft_pred = ttft_pred_mean[0] + std_factor * ttft_std[0]
                    tpot_pred = tpot_pred_mean[0] + std_factor * tpot_std[0]

                    return ttft_pred, tpot_pred, ttft_std[0], tpot_std[0]

                elif self.model_type == ModelType.XGBOOST:
                    # XGBoost quantile regression directly predicts the quantile
                    ttft_pred = self.ttft_model.predict(df_ttft)
                    tpot_pred = self.tpot_model.predict(df_tpot)

                    # For XGBoost quantile regression, uncertainty estimation is more complex
                    ttft_std = ttft_pred[0] * 0.1  # 10% of prediction as uncertainty estimate
                    tpot_std = tpot_pred[0] * 0.1

                    return ttft_pred[0], tpot_pred[0], ttft_std, tpot_std

                else:  # LightGBM with quantile regression
                    # LightGBM quantile regression directly predicts the quantile
                    ttft_pred = self.ttft_model.predict(df_ttft)
                    tpot_pred = self.tpot_model.predict(df_tpot)

                    # For LightGBM quantile regression, use a similar uncertainty estimate as XGBoost
                    ttft_std = ttft_pred[0] * 0.1  # 10% of prediction as uncertainty estimate
                    tpot_std = tpot_pred[0] * 0.1

                    return ttft_pred[0], tpot_pred[0], ttft_std, tpot_std

        except ValueError as ve:
            logging.warning(f"Client error in predict(): {ve}")
            raise HTTPException(status_code=400, detail=str(ve))
        except HTTPException:
            raise
        except Exception:
            logging.error("Error in predict():", exc_info=True)
            raise HTTPException(status_code=500, detail="Internal error during prediction")

    def add_training_sample(self, sample: dict):
        try:
            required = [
                "kv_cache_percentage",
                "actual_ttft_ms",
                "actual_tpot_ms",
                "num_tokens_generated",
                "input_token_length",
                "num_request_waiting",
                "num_request_running",
                "prefix_cache_score",
            ]
            for field in required:
                if field not in sample or not isinstance(sample[field], int | float):
                    logging.warning(f"Invalid sample field: {field}")
                    return

            # Use hash-based deterministic split to ensure consistent train/test assignment
            # This ensures the same sample always goes to the same split
            sample_hash = hash(str(sorted(sample.items())))
            is_test = (sample_hash % 100) < (settings.TEST_TRAIN_RATIO * 100)

            # Create subsets based on conditions
            ttft_valid = sample["actual_ttft_ms"] > 0
            tpot_valid = sample["actual_tpot_ms"] > 0

            if is_test:
                # Add to test data only if the respective metric is valid
                if ttft_valid:
                    self.ttft_test_data.append(sample.copy())
                if tpot_valid:
                    self.tpot_test_data.append(sample.copy())
            else:
                # Add to training buckets only if the respective metric is valid
                bucket_key = self._get_bucket_key(sample)

                if ttft_valid:
                    self.ttft_data_buckets[bucket_key].append(sample)
                if tpot_valid:
                    self.tpot_data_buckets[bucket_key].append(sample)

        except Exception as e:
            logging.error(f"Error adding training sample: {e}", exc_info=True)

    def add_training_samples(self, samples: list):
        """Bulk-add multiple training samples in one go."""
        with self.lock:
            for sample in samples:
                try:
                    # reuse the single-sample logic
                    self.add_training_sample(sample)
                except Exception:
                    # log & continue on individual failures
                    logging.exception("Failed to add one sample in bulk ingestion")

    # Update the _save_models_unlocked method to handle LightGBM model exports
    def _save_models_unlocked(self):
        try:
            if self.ttft_model:
                os.makedirs(os.path.dirname(settings.TTFT_MODEL_PATH), exist_ok=True)
                joblib.dump(self.ttft_model, settings.TTFT_MODEL_PATH)
                logging.info("TTFT model saved.")

                # Save model-specific exports
                if self.model_type == ModelType.XGBOOST:
                    try:
                        booster = self.ttft_model.get_booster()
                        raw_trees = booster.get_dump(dump_format="json")
                        trees = [json.loads(t) for t in raw_trees]

                        ttft_json_path = settings.TTFT_MODEL_PATH.replace(".joblib", "_trees.json")
                        with open(ttft_json_path, "w") as f:
                            json.dump(trees, f, indent=2)
                        logging.info(f"TTFT XGBoost trees saved to {ttft_json_path}")
                    except Exception as e:
                        logging.error(f"Error saving TTFT XGBoost trees: {e}", exc_info=True)

                elif self.model_type == ModelType.LIGHTGBM:
                    try:
                        # Save LightGBM model as text format
                        ttft_txt_path = settings.TTFT_MODEL_PATH.replace(".joblib", "_lgb.txt")
                        self.ttft_model.booster_.save_model(ttft_txt_path)

                        # Save feature importances as JSON
                        feature_names = self.ttft_model.booster_.feature_name()
                        importances = dict(zip(feature_names, self.ttft_model.feature_importances_))

                        ttft_imp_path = settings.TTFT_MODEL_PATH.replace(".joblib", "_importances.json")
                        with open(ttft_imp_path, "w") as f:
                            json.dump(importances, f, indent=2)

                        logging.info(f"TTFT LightGBM model saved to {ttft_txt_path}")
                        logging.info(f"TTFT LightGBM importances saved to {ttft_imp_path}")
                    except Exception as e:
                        logging.error(f"Error saving TTFT LightGBM exports: {e}", exc_info=True)

            if self.ttft_scaler and self.model_type == ModelType.BAYESIAN_RIDGE:
                os.makedirs(os.path.dirname(settings.TTFT_SCALER_PATH), exist_ok=True)
                joblib.dump(self.ttft_scaler, settings.TTFT_SCALER_PATH)
                logging.info("TTFT scaler saved.")

            if self.tpot_model:
                os.makedirs(os.path.dirname(settings.TPOT_MODEL_PATH), exist_ok=True)
                joblib.dump(self.tpot_model, settings.TPOT_MODEL_PATH)
                logging.info("TPOT model saved.")

                # Save model-specific exports
                if self.model_type == ModelType.XGBOOST:
                    try:
                        booster = self.tpot_model.get_booster()
                        raw_trees = booster.get_dump(dump_format="json")
                        trees = [json.loads(t) for t in raw_trees]

                        tpot_json_path = settings.TPOT_MODEL_PATH.replace(".joblib", "_trees.json")
                        with open(tpot_json_path, "w") as f:
                            json.dump(trees, f, indent=2)
                        logging.info(f"TPOT XGBoost trees saved to {tpot_json_path}")
                    except Exception as e:
                        logging.error(f"Error saving TPOT XGBoost trees: {e}", exc_info=True)

                elif self.model_type == ModelType.LIGHTGBM:
                    try:
                        # Save LightGBM model as text format
                        tpot_txt_path = settings.TPOT_MODEL_PATH.replace(".joblib", "_lgb.txt")
                        self.tpot_model.booster_.save_model(tpot_txt_path)

                        # Save feature importances as JSON
                        feature_names = self.tpot_model.booster_.feature_name()
                        importances = dict(zip(feature_names, self.tpot_model.feature_importances_))

                        tpot_imp_path = settings.TPOT_MODEL_PATH.replace(".joblib", "_importances.json")
                        with open(tpot_imp_path, "w") as f:
                            json.dump(importances, f, indent=2)

                        logging.info(f"TPOT LightGBM model saved to {tpot_txt_path}")
                        logging.info(f"TPOT LightGBM importances saved to {tpot_imp_path}")
                    except Exception as e:
                        logging.error(f"Error saving TPOT LightGBM exports: {e}", exc_info=True)

            if self.tpot_scaler and self.model_type == ModelType.BAYESIAN_RIDGE:
                os.makedirs(os.path.dirname(settings.TPOT_SCALER_PATH), exist_ok=True)
                joblib.dump(self.tpot_scaler, settings.TPOT_SCALER_PATH)
                logging.info("TPOT scaler saved.")

            # Save gated ensemble models (2 files instead of 8)
            if self.ensemble_active:
                for gated, path, name in [
                    (self.ttft_gated, settings.TTFT_GATED_MODEL_PATH, "TTFT gated"),
                    (self.tpot_gated, settings.TPOT_GATED_MODEL_PATH, "TPOT gated"),
                ]:
                    if gated:
                        os.makedirs(os.path.dirname(path), exist_ok=True)
                        joblib.dump(gated, path)
                        logging.info(f"{name} ensemble model saved.")

        except Exception as e:
            logging.error(f"Error saving models: {e}", exc_info=True)

    def flush_training_data(
        self, flush_training: bool = True, flush_test: bool = True, flush_metrics: bool = True, reason: str = None
    ) -> dict:
        """
        Manually flush training data, test data, and/or metrics.
        Returns statistics about what was flushed.

        Args:
            flush_training: Whether to flush training data buckets
            flush_test: Whether to flush test data
            flush_metrics: Whether to flush quantile metric scores
            reason: Optional reason for flushing (for logging)

        Returns:
            Dictionary with flush statistics
        """
        try:
            with self.lock:
                # Count samples before flushing (handles 3D buckets)
                ttft_training_count = sum(len(bucket) for bucket in self.ttft_data_buckets.values())
                tpot_training_count = sum(len(bucket) for bucket in self.tpot_data_buckets.values())
                ttft_test_count = len(self.ttft_test_data)
                tpot_test_count = len(self.tpot_test_data)

                reason_str = f" Reason: {reason}" if reason else ""
                logging.info(
                    f"Manual flush requested.{reason_str} "
                    f"Training: {flush_training}, Test: {flush_test}, Metrics: {flush_metrics}"
                )

                # Flush training data (now handles 3D buckets automatically)
                if flush_training:
                    for bucket_key in self.ttft_data_buckets:
                        self.ttft_data_buckets[bucket_key].clear()
                    for bucket_key in self.tpot_data_buckets:
                        self.tpot_data_buckets[bucket_key].clear()
                    logging.info(f"Flushed {ttft_training_count} TTFT and {tpot_training_count} TPOT training samples")

                # Flush test data
                if flush_test:
                    self.ttft_test_data.clear()
                    self.tpot_test_data.clear()
                    logging.info(f"Flushed {ttft_test_count} TTFT and {tpot_test_count} TPOT test samples")

                # Clear metrics
                metrics_cleared = False
                if flush_metrics:
                    self.ttft_quantile_loss_scores.clear()
                    self.tpot_quantile_loss_scores.clear()
                    self.ttft_coverage_scores.clear()
                    self.tpot_coverage_scores.clear()
                    self.ttft_violation_rates.clear()
                    self.tpot_violation_rates.clear()
                    self.ttft_mae_scores.clear()
                    self.tpot_mae_scores.clear()
                    self.ttft_rmse_scores.clear()
                    self.tpot_rmse_scores.clear()
                    metrics_cleared = True
                    logging.info("Cleared all metric scores")

                return {
                    "success": True,
                    "ttft_training_samples_flushed": ttft_training_count if flush_training else 0,
                    "tpot_training_samples_flushed": tpot_training_count if flush_training else 0,
                    "ttft_test_samples_flushed": ttft_test_count if flush_test else 0,
                    "tpot_test_samples_flushed": tpot_test_count if flush_test else 0,
                    "metrics_cleared": metrics_cleared,
                }

        except Exception as e:
            logging.error(f"Error flushing data: {e}", exc_info=True)
            raise

    def load_models(self):
        try:
            with self.lock:
                if os.path.exists(settings.TTFT_MODEL_PATH):
                    self.ttft_model = joblib.load(settings.TTFT_MODEL_PATH)
                    if self.model_type == ModelType.BAYESIAN_RIDGE and os.path.exists(settings.TTFT_SCALER_PATH):
                        self.ttft_scaler = joblib.load(settings.TTFT_SCALER_PATH)
                    meta_path = os.path.join(os.path.dirname(settings.TTFT_MODEL_PATH), "metadata.json")
                    if os.path.exists(meta_path):
                        try:
                            with open(meta_path) as f:
                                seed_meta = json.load(f)
                            logging.info("Loaded seed model: %s", seed_meta)
                        except Exception:
                            logging.warning("Failed to read seed metadata from %s", meta_path)
                else:
                    result = self._create_default_model("ttft")
                    if self.model_type == ModelType.BAYESIAN_RIDGE:
                        self.ttft_model, self.ttft_scaler = result
                    else:
                        self.ttft_model = result
                    settings.MIN_SAMPLES_FOR_RETRAIN = settings.MIN_SAMPLES_FOR_RETRAIN_FRESH
                    self._save_models_unlocked()

                if os.path.exists(settings.TPOT_MODEL_PATH):
                    self.tpot_model = joblib.load(settings.TPOT_MODEL_PATH)
                    if self.model_type == ModelType.BAYESIAN_RIDGE and os.path.exists(settings.TPOT_SCALER_PATH):
                        self.tpot_scaler = joblib.load(settings.TPOT_SCALER_PATH)
                else:
                    result = self._create_default_model("tpot")
                    if self.model_type == ModelType.BAYESIAN_RIDGE:
                        self.tpot_model, self.tpot_scaler = result
                    else:
                        self.tpot_model = result
                    settings.MIN_SAMPLES_FOR_RETRAIN = settings.MIN_SAMPLES_FOR_RETRAIN_FRESH
                    self._save_models_unlocked()

                if not self.is_ready:
                    raise RuntimeError("Failed to initialize models/scalers")
        except Exception as e:
            logging.error(f"Critical error in load_models: {e}", exc_info=True)
            raise

    def get_metrics(self) -> str:
        """Render Prometheus-style metrics: model, coefficients/importances, bucket counts, and quantile-specific scores."""
        try:
            # Snapshot models & scalers
            ttft_model, tpot_model = self.ttft_model, self.tpot_model
            ttft_scaler, tpot_scaler = self.ttft_scaler, self.tpot_scaler  # noqa: F841  # snapshotted alongside models for future use

            lines: list[str] = []
            # 1) Model type, objective, and quantile info
            lines.append(f'model_type{{type="{self.model_type.value}"}} 1')
            lines.append(f'objective_type{{type="{self.objective_type.value}"}} 1')
            lines.append(f"model_quantile{{}} {self.quantile}")
            lines.append(f"ensemble_active{{}} {1 if self.ensemble_active else 0}")
            lines.append(f"ensemble_mode{{}} {1 if settings.ENSEMBLE_MODE else 0}")

            # Helper: emit linear‐model coefs or tree importances
            def emit_metrics(model, coefficients, feats, prefix):
                if model is None:
                    # placeholders
                    lines.append(f"{prefix}_intercept{{}} 0.0")
                    kind = "coef" if self.model_type == ModelType.BAYESIAN_RIDGE else "importance"
                    for f in feats:
                        lines.append(f'{prefix}_{kind}{{feature="{f}"}} 0.0')
                    return

                if self.model_type == ModelType.BAYESIAN_RIDGE:
                    # Use stored descaled coefficients
                    if coefficients:
                        lines.append(f"{prefix}_intercept{{}} {coefficients.get('intercept', 0.0):.6f}")
                        for f in feats:
                            coef_value = coefficients.get(f, 0.0)
                            lines.append(f'{prefix}_coef{{feature="{f}"}} {coef_value:.6f}')
                    else:
                        # Fallback to zeros if coefficients not available
                        lines.append(f"{prefix}_intercept{{}} 0.0")
                        for f in feats:
                            lines.append(f'{prefix}_coef{{feature="{f}"}} 0.0')
                else:
                    # XGBoost/LightGBM importances. Label from the model's own feature
                    # names (recorded at fit time from the training DataFrame) so labels
                    # track importances no matter which optional feature groups
                    # (token-in-flight, encoder) were enabled at train time. A hardcoded
                    # list would mislabel every column after a disabled group, since
                    # zip() pairs by position.
                    try:
                        imps = model.feature_importances_
                    except Exception:
                        imps = [0.0] * len(feats)
                    names = getattr(model, "feature_names_in_", None)
                    if names is None:
                        try:
                            names = model.booster_.feature_name()  # LightGBM
                        except Exception:
                            try:
                                names = model.get_booster().feature_names  # XGBoost
                            except Exception:
                                names = feats
                    lines.append(f"{prefix}_intercept{{}} 0.0")
                    for f, imp in zip(names, imps):
                        lines.append(f'{prefix}_importance{{feature="{f}"}} {imp:.6f}')

            if self.model_type == ModelType.BAYESIAN_RIDGE:
                ttft_feats = [
                    "is_queued",
                    "kv_cache_percentage",
                    "input_token_length",
                    "num_request_waiting",
                    "num_request_running",
                    "prefill_tokens_in_flight",
                    "decode_tokens_in_flight",
                    "encoder_matched_size",
                    "encoder_input_size",
                    "prefix_cache_score",
                    "effective_input_tokens",
                ]
                tpot_feats = [
                    "is_queued",
                    "kv_cache_percentage",
                    "input_token_length",
                    "num_request_waiting",
                    "num_request_running",
                    "prefill_tokens_in_flight",
                    "decode_tokens_in_flight",
                    "num_tokens_generated",
                ]
            else:
                ttft_feats = [
                    "is_queued",
                    "kv_cache_percentage",
                    "input_token_length",
                    "num_request_waiting",
                    "num_request_running",
                    "prefill_tokens_in_flight",
                    "decode_tokens_in_flight",
                    "encoder_matched_size",
                    "encoder_input_size",
                    "prefix_cache_score",
                    "effective_input_tokens",
                    "prefill_score_bucket",
                    "pod_type_cat",
                ]
                tpot_feats = [
                    "is_queued",
                    "kv_cache_percentage",
                    "input_token_length",
                    "num_request_waiting",
                    "num_request_running",
                    "prefill_tokens_in_flight",
                    "decode_tokens_in_flight",
                    "num_tokens_generated",
                    "pod_type_cat",
                ]
            emit_metrics(ttft_model, self.ttft_coefficients, ttft_feats, "ttft")
            emit_metrics(tpot_model, self.tpot_coefficients, tpot_feats, "tpot")

            # 3) Multi-dimensional bucket counts with 3D keys
            for (queue_bucket, cache_bucket, prefix_bucket), bucket_deque in self.ttft_data_buckets.items():
                count = len(bucket_deque)
                lines.append(
                    f'training_samples_count{{model="ttft",queue_bucket="{queue_bucket}",cache_bucket="{cache_bucket}",prefix_bucket="{prefix_bucket}"}} {count}'
                )

            for (queue_bucket, cache_bucket, prefix_bucket), bucket_deque in self.tpot_data_buckets.items():
                count = len(bucket_deque)
                lines.append(
                    f'training_samples_count{{model="tpot",queue_bucket="{queue_bucket}",cache_bucket="{cache_bucket}",prefix_bucket="{prefix_bucket}"}} {count}'
                )

            # Summary metrics by queue state
            for q in range(self.queue_buckets):
                ttft_total = sum(
                    len(self.ttft_data_buckets[(q, c, p)])
                    for c in range(self.cache_buckets)
                    for p in range(self.prefix_buckets)
                )
                tpot_total = sum(
                    len(self.tpot_data_buckets[(q, c, p)])
                    for c in range(self.cache_buckets)
                    for p in range(self.prefix_buckets)
                )
                lines.append(f'training_samples_queue_total{{model="ttft",queue_bucket="{q}"}} {ttft_total}')
                lines.append(f'training_samples_queue_total{{model="tpot",queue_bucket="{q}"}} {tpot_total}')

            # Summary metrics by cache state
            for c in range(self.cache_buckets):
                ttft_total = sum(
                    len(self.ttft_data_buckets[(q, c, p)])
                    for q in range(self.queue_buckets)
                    for p in range(self.prefix_buckets)
                )
                tpot_total = sum(
                    len(self.tpot_data_buckets[(q, c, p)])
                    for q in range(self.queue_buckets)
                    for p in range(self.prefix_buckets)
                )
                lines.append(f'training_samples_cache_total{{model="ttft",cache_bucket="{c}"}} {ttft_total}')
                lines.append(f'training_samples_cache_total{{model="tpot",cache_bucket="{c}"}} {tpot_total}')

            # Summary metrics by prefix state
            for p in range(self.prefix_buckets):
                ttft_total = sum(
                    len(self.ttft_data_buckets[(q, c, p)])
                    for q in range(self.queue_buckets)
                    for c in range(self.cache_buckets)
                )
                tpot_total = sum(
                    len(self.tpot_data_buckets[(q, c, p)])
                    for q in range(self.queue_buckets)
                    for c in range(self.cache_buckets)
                )

                # Calculate prefix range for this bucket
                prefix_low = p / self.prefix_buckets
                prefix_high = (p + 1) / self.prefix_buckets

                lines.append(
                    f'training_samples_prefix_total{{model="ttft",prefix_bucket="{p}",range="{prefix_low:.2f}-{prefix_high:.2f}"}} {ttft_total}'
                )
                lines.append(
                    f'training_samples_prefix_total{{model="tpot",prefix_bucket="{p}",range="{prefix_low:.2f}-{prefix_high:.2f}"}} {tpot_total}'
                )

            # Add prefix score distribution statistics
            all_ttft_samples = self._all_samples(self.ttft_data_buckets)
            if all_ttft_samples:
                prefix_scores = [s["prefix_cache_score"] for s in all_ttft_samples]
                ttfts = [s["actual_ttft_ms"] for s in all_ttft_samples]

                lines.append(f"prefix_score_mean{{}} {np.mean(prefix_scores):.4f}")
                lines.append(f"prefix_score_std{{}} {np.std(prefix_scores):.4f}")
                lines.append(f"prefix_score_min{{}} {np.min(prefix_scores):.4f}")
                lines.append(f"prefix_score_max{{}} {np.max(prefix_scores):.4f}")

                # Average TTFT by prefix bucket
                for p in range(self.prefix_buckets):
                    prefix_low = p / self.prefix_buckets
                    prefix_high = (p + 1) / self.prefix_buckets

                    if p == self.prefix_buckets - 1:
                        mask = [(prefix_low <= score <= prefix_high) for score in prefix_scores]  # include 1.0
                    else:
                        mask = [(prefix_low <= score < prefix_high) for score in prefix_scores]
                    bucket_ttfts = [t for t, m in zip(ttfts, mask) if m]

                    if bucket_ttfts:
                        avg_ttft = np.mean(bucket_ttfts)
                        median_ttft = np.median(bucket_ttfts)
                        lines.append(
                            f'avg_ttft_by_prefix{{prefix_bucket="{p}",range="{prefix_low:.2f}-{prefix_high:.2f}"}} {avg_ttft:.2f}'
                        )
                        lines.append(
                            f'median_ttft_by_prefix{{prefix_bucket="{p}",range="{prefix_low:.2f}-{prefix_high:.2f}"}} {median_ttft:.2f}'
                        )

            if self.objective_type == ObjectiveType.MEAN:
                # 4) MAE scores (last up to 5)
                for idx, score in enumerate(self.ttft_mae_scores):
                    lines.append(f'ttft_mae{{idx="{idx}"}} {score:.6f}')
                for idx, score in enumerate(self.tpot_mae_scores):
                    lines.append(f'tpot_mae{{idx="{idx}"}} {score:.6f}')

                # 5) RMSE scores
                for idx, score in enumerate(self.ttft_rmse_scores):
                    lines.append(f'ttft_rmse{{idx="{idx}"}} {score:.6f}')
                for idx, score in enumerate(self.tpot_rmse_scores):
                    lines.append(f'tpot_rmse{{idx="{idx}"}} {score:.6f}')
            else:
                # 4) Quantile Loss scores (last up to 5)
                for idx, score in enumerate(self.ttft_quantile_loss_scores):
                    lines.append(f'ttft_quantile_loss{{idx="{idx}"}} {score:.6f}')
                for idx, score in enumerate(self.tpot_quantile_loss_scores):
                    lines.append(f'tpot_quantile_loss{{idx="{idx}"}} {score:.6f}')

                # 5) Coverage scores (should be close to quantile * 100)
                for idx, coverage in enumerate(self.ttft_coverage_scores):
                    lines.append(f'ttft_coverage_percent{{idx="{idx}"}} {coverage:.6f}')
                for idx, coverage in enumerate(self.tpot_coverage_scores):
                    lines.append(f'tpot_coverage_percent{{idx="{idx}"}} {coverage:.6f}')

                # 6) Violation rates (should be close to (1-quantile) * 100)
                for idx, violation_rate in enumerate(self.ttft_violation_rates):
                    lines.append(f'ttft_violation_rate_percent{{idx="{idx}"}} {violation_rate:.6f}')
                for idx, violation_rate in enumerate(self.tpot_violation_rates):
                    lines.append(f'tpot_violation_rate_percent{{idx="{idx}"}} {violation_rate:.6f}')

                # 7) Target metrics for reference
                target_coverage = self.quantile * 100
                target_violation_rate = (1 - self.quantile) * 100
                lines.append(f"target_coverage_percent{{}} {target_coverage:.1f}")
                lines.append(f"target_violation_rate_percent{{}} {target_violation_rate:.1f}")

            return "\n".join(lines) + "\n"

        except Exception as e:
            logging.error(f"Error generating metrics: {e}", exc_info=True)
            return "# error_generating_metrics 1\n"


# --- FastAPI Application ---
app = FastAPI(
    title="Latency Predictor Service",
    description="A service to predict TTFT and TPOT using quantile or mean regression with continuous training and feature scaling.",
)

predictor = LatencyPredictor()


# --- Pydantic Models for API ---
class TrainingEntry(BaseModel):
    kv_cache_percentage: float = Field(..., ge=0.0, le=1.0)
    input_token_length: int = Field(..., ge=0)
    num_request_waiting: int = Field(..., ge=0)
    num_request_running: int = Field(..., ge=0)
    actual_ttft_ms: float = Field(..., ge=0.0)
    actual_tpot_ms: float = Field(..., ge=0.0)
    num_tokens_generated: int = Field(..., ge=0)
    prefix_cache_score: float = Field(..., ge=0.0, le=1.0, description="Prefix cache hit ratio score (0.0 to 1.0)")
    pod_type: str | None = Field(default="", description="Pod type: 'prefill', 'decode', or '' for monolithic")
    prefill_tokens_in_flight: int = Field(default=0, ge=0)
    decode_tokens_in_flight: int = Field(default=0, ge=0)
    encoder_matched_size: int = Field(default=0, ge=0, description="Encoder cache matched size (multimodal)")
    encoder_input_size: int = Field(default=0, ge=0, description="Encoder input size (multimodal)")
    timestamp: datetime = Field(default_factory=lambda: datetime.now(UTC))


class PredictionRequest(BaseModel):
    kv_cache_percentage: float = Field(..., ge=0.0, le=1.0)
    input_token_length: int = Field(..., ge=0)
    num_request_waiting: int = Field(..., ge=0)
    num_request_running: int = Field(..., ge=0)
    num_tokens_generated: int = Field(..., ge=0)
    prefix_cache_score: float = Field(..., ge=0.0, le=1.0, description="Prefix cache hit ratio score (0.0 to 1.0)")
    pod_type: str | None = Field(default="", description="Pod type: 'prefill', 'decode', or '' for monolithic")
    encoder_matched_size: int = Field(default=0, ge=0, description="Encoder cache matched size (multimodal)")
    encoder_input_size: int = Field(default=0, ge=0, description="Encoder input size (multimodal)")


class PredictionResponse(BaseModel):
    ttft_ms: float = Field(..., description="Predicted TTFT in milliseconds (mean or quantile depending on objective)")
    tpot_ms: float = Field(..., description="Predicted TPOT in milliseconds (mean or quantile depending on objective)")
    ttft_uncertainty: float = Field(..., description="Uncertainty estimate for TTFT prediction")
    tpot_uncertainty: float = Field(..., description="Uncertainty estimate for TPOT prediction")
    ttft_prediction_bounds: tuple[float, float] = Field(..., description="Approximate prediction bounds for TTFT")
    tpot_prediction_bounds: tuple[float, float] = Field(..., description="Approximate prediction bounds for TPOT")
    predicted_at: datetime
    model_type: ModelType = Field(default=predictor.model_type.value, description="Type of model used for prediction")
    objective_type: str = Field(
        default=settings.OBJECTIVE_TYPE.value, description="Prediction objective: 'quantile' or 'mean'"
    )
    quantile: float = Field(
        default=settings.QUANTILE_ALPHA, description="Quantile being predicted (relevant when objective is 'quantile')"
    )


class BulkTrainingRequest(BaseModel):
    entries: list[TrainingEntry]


# --- Background Training Loop ---
def continuous_training_loop():
    time.sleep(10)
    while not predictor._shutdown_event.is_set():
        try:
            logging.debug("Checking if training should run...")
            predictor.train()
        except Exception:
            logging.error("Error in periodic retraining", exc_info=True)
        if predictor._shutdown_event.wait(timeout=settings.RETRAINING_INTERVAL_SEC):
            break
    logging.info("Training loop exiting.")


# --- FastAPI Events ---
@app.on_event("startup")
async def startup_event():
    logging.info("Server starting up...")
    predictor.load_models()
    t = threading.Thread(target=continuous_training_loop, daemon=True)
    predictor._training_thread = t
    t.start()
    logging.info("Background training started.")


@app.on_event("shutdown")
async def shutdown_event():
    logging.info("Server shutting down...")
    predictor.shutdown()


@app.post("/add_training_data_bulk", status_code=status.HTTP_202_ACCEPTED)
async def add_training_data_bulk(batch: BulkTrainingRequest):
    """
    Accepts a JSON body like:
      { "entries": [ { …TrainingEntry… }, { … }, … ] }
    """
    try:
        predictor.add_training_samples([e.model_dump() for e in batch.entries])
        return {"message": f"Accepted {len(batch.entries)} training samples."}
    except Exception:
        logging.error("Failed to add bulk training data", exc_info=True)
        raise HTTPException(status_code=500, detail="Failed to add training data in bulk")


@app.post("/predict", response_model=PredictionResponse)
async def predict_endpoint(request: PredictionRequest):
    try:
        ttft_pred, tpot_pred, ttft_std, tpot_std = predictor.predict(request.model_dump())
        ttft_pred = max(0, ttft_pred)
        tpot_pred = max(0, tpot_pred)
        ttft_bounds = (max(0, ttft_pred - 2 * ttft_std), ttft_pred + 2 * ttft_std)
        tpot_bounds = (max(0, tpot_pred - 2 * tpot_std), tpot_pred + 2 * tpot_std)
        return PredictionResponse(
            ttft_ms=ttft_pred,
            tpot_ms=tpot_pred,
            ttft_uncertainty=ttft_std,
            tpot_uncertainty=tpot_std,
            ttft_prediction_bounds=ttft_bounds,
            tpot_prediction_bounds=tpot_bounds,
            predicted_at=datetime.now(UTC),
            model_type=predictor.model_type.value,
            objective_type=predictor.objective_type.value,
            quantile=predictor.quantile,
        )
    except HTTPException:
        raise
    except Exception:
        logging.error("Prediction failed", exc_info=True)
        raise HTTPException(status_code=500, detail="An internal error occurred during prediction.")


@app.get("/healthz", status_code=status.HTTP_200_OK)
async def health_check():
    return {"status": "ok"}


@app.get("/readyz", status_code=status.HTTP_200_OK)
async def readiness_check():
    if not predictor.is_ready:
        raise HTTPException(status_code=status.HTTP_503_SERVICE_UNAVAILABLE, detail="Models are not ready.")
    return {"status": "ready"}


@app.get("/model/export")
def export_models():
    """Bundle trained models and metadata for seeding new deployments."""
    if not predictor.is_ready:
        raise HTTPException(status_code=status.HTTP_503_SERVICE_UNAVAILABLE, detail="Models are not ready.")

    # Exclude gated ensemble models from seed bundles: load_models() never
    # loads them, but the prediction server syncs them on file existence and
    # would then dispatch all traffic through the source deployment's frozen
    # gate, masking local base-model retraining until ensemble_active flips.
    paths = {name: path for name, path in _get_model_paths().items() if name not in ("ttft_gated", "tpot_gated")}

    with predictor.lock:
        snapshots = {}
        for name, p in paths.items():
            if os.path.exists(p):
                with open(p, "rb") as f:
                    snapshots[name] = f.read()
        meta = {
            "model_type": predictor.model_type.value,
            "quantile_alpha": settings.QUANTILE_ALPHA,
            "exported_at": datetime.now(UTC).isoformat(),
            "ttft_samples": sum(len(d) for d in predictor.ttft_data_buckets.values()),
            "tpot_samples": sum(len(d) for d in predictor.tpot_data_buckets.values()),
        }

    buf = io.BytesIO()
    with tarfile.open(fileobj=buf, mode="w:gz") as tar:
        for name, data in snapshots.items():
            info = tarfile.TarInfo(name=os.path.basename(paths[name]))
            info.size = len(data)
            info.mtime = int(time.time())
            tar.addfile(info, io.BytesIO(data))
        meta_bytes = json.dumps(meta, indent=2).encode()
        meta_info = tarfile.TarInfo(name="metadata.json")
        meta_info.size = len(meta_bytes)
        meta_info.mtime = int(time.time())
        tar.addfile(meta_info, io.BytesIO(meta_bytes))

    buf.seek(0)
    return StreamingResponse(
        buf,
        media_type="application/gzip",
        headers={"Content-Disposition": "attachment; filename=seed-model.tar.gz"},
    )


@app.get("/metrics", status_code=status.HTTP_200_OK)
async def metrics():
    """Prometheus metrics including coefficients/importances, bucket counts, and quantile-specific metrics."""
    try:
        content = predictor.get_metrics()
        return Response(content, media_type="text/plain; version=0.0.4")
    except Exception as e:
        logging.error(f"Error in metrics endpoint: {e}", exc_info=True)
        return Response("# Error generating metrics\n", media_type="text/plain; version=0.0.4")


@app.get("/", include_in_schema=False)
async def root():
    if predictor.objective_type == ObjectiveType.MEAN:
        desc = "Predicting mean TTFT and TPOT latencies"
    else:
        desc = f"Predicting {predictor.quantile:.0%} quantile for TTFT and TPOT latencies"
    return {
        "message": "Latency Predictor is running.",
        "model_type": predictor.model_type.value,
        "objective_type": predictor.objective_type.value,
        "quantile": predictor.quantile,
        "description": desc,
    }


@app.post("/flush", response_model=FlushResponse, status_code=status.HTTP_200_OK)
async def flush_data(request: FlushRequest = FlushRequest()):
    """
    Manually flush training data, test data, and/or metrics.

    Useful when:
    - Server workload has changed significantly
    - You want to start fresh with new data
    - Testing or debugging model behavior
    - Forcing a clean state after deployment

    Example requests:
    - Flush everything: POST /flush with empty body
    - Flush only training: POST /flush with {"flush_test_data": false, "flush_metrics": false}
    - Flush with reason: POST /flush with {"reason": "New deployment"}
    """
    try:
        result = predictor.flush_training_data(
            flush_training=request.flush_training_data,
            flush_test=request.flush_test_data,
            flush_metrics=request.flush_metrics,
            reason=request.reason,
        )

        (
            result["ttft_training_samples_flushed"]
            + result["tpot_training_samples_flushed"]
            + result["ttft_test_samples_flushed"]
            + result["tpot_test_samples_flushed"]
        )

        message_parts = []
        if request.flush_training_data:
            message_parts.append(
                f"{result['ttft_training_samples_flushed']} TTFT and "
                f"{result['tpot_training_samples_flushed']} TPOT training samples"
            )
        if request.flush_test_data:
            message_parts.append(
                f"{result['ttft_test_samples_flushed']} TTFT and "
                f"{result['tpot_test_samples_flushed']} TPOT test samples"
            )
        if request.flush_metrics:
            message_parts.append("all metric scores")

        message = f"Successfully flushed: {', '.join(message_parts)}" if message_parts else "No data flushed"

        return FlushResponse(
            success=True,
            flushed_at=datetime.now(UTC),
            reason=request.reason,
            ttft_training_samples_flushed=result["ttft_training_samples_flushed"],
            tpot_training_samples_flushed=result["tpot_training_samples_flushed"],
            ttft_test_samples_flushed=result["ttft_test_samples_flushed"],
            tpot_test_samples_flushed=result["tpot_test_samples_flushed"],
            metrics_cleared=result["metrics_cleared"],
            message=message,
        )

    except Exception as e:
        logging.error(f"Error in flush endpoint: {e}", exc_info=True)
        raise HTTPException(status_code=500, detail=f"Failed to flush data: {str(e)}")


@app.get("/data/status", status_code=status.HTTP_200_OK)
async def get_data_status():
    """
    Get current status of training data.
    Useful for monitoring and deciding whether to flush.
    """
    ttft_training_count = sum(len(bucket) for bucket in predictor.ttft_data_buckets.values())
    tpot_training_count = sum(len(bucket) for bucket in predictor.tpot_data_buckets.values())

    bucket_distribution = {}
    for (q, c, p), bucket in predictor.ttft_data_buckets.items():
        if len(bucket) > 0:
            key = f"queue_{q}_cache_{c}_prefix_{p}"
            bucket_distribution[key] = len(bucket)

    # Compute per-regime sample counts
    ttft_noqueue, ttft_queued = predictor._split_samples_by_queue(predictor.ttft_data_buckets)
    tpot_noqueue, tpot_queued = predictor._split_samples_by_queue(predictor.tpot_data_buckets)

    return {
        "training_data": {
            "ttft_samples": ttft_training_count,
            "tpot_samples": tpot_training_count,
            "total_samples": ttft_training_count + tpot_training_count,
        },
        "test_data": {
            "ttft_samples": len(predictor.ttft_test_data),
            "tpot_samples": len(predictor.tpot_test_data),
            "total_samples": len(predictor.ttft_test_data) + len(predictor.tpot_test_data),
        },
        "ensemble": {
            "ensemble_mode": settings.ENSEMBLE_MODE,
            "ensemble_active": predictor.ensemble_active,
            "min_samples_for_split": settings.MIN_SAMPLES_FOR_ENSEMBLE_SPLIT,
            "ttft_noqueue_samples": len(ttft_noqueue),
            "ttft_queued_samples": len(ttft_queued),
            "tpot_noqueue_samples": len(tpot_noqueue),
            "tpot_queued_samples": len(tpot_queued),
        },
        "metrics": {
            "ttft_scores_count": len(predictor.ttft_quantile_loss_scores),
            "tpot_scores_count": len(predictor.tpot_quantile_loss_scores),
        },
        "bucket_distribution": bucket_distribution,
        "model_ready": predictor.is_ready,
        "last_retrain": predictor.last_retrain_time.isoformat() if predictor.last_retrain_time else None,
    }


@app.get("/model/download/info")
async def model_download_info():
    """
    Get information about available model downloads and coefficients.
    """
    info = {"model_type": predictor.model_type.value, "quantile": predictor.quantile, "available_endpoints": {}}

    if predictor.model_type == ModelType.BAYESIAN_RIDGE:
        info["available_endpoints"]["coefficients"] = "/metrics"
        info["coefficients_info"] = {
            "ttft_coefficients_available": predictor.ttft_coefficients is not None,
            "tpot_coefficients_available": predictor.tpot_coefficients is not None,
            "description": "Descaled coefficients available in Prometheus metrics endpoint",
        }
    elif predictor.model_type == ModelType.XGBOOST:
        info["available_endpoints"]["trees"] = {
            "ttft_trees": "/model/ttft/xgb/json",
            "tpot_trees": "/model/tpot/xgb/json",
        }
    else:
        info["available_endpoints"]["lightgbm"] = {
            "ttft_model_txt": "/model/ttft/lgb/txt",
            "tpot_model_txt": "/model/tpot/lgb/txt",
            "ttft_importances": "/model/ttft/lgb/importances",
            "tpot_importances": "/model/tpot/lgb/importances",
        }

    info["model_status"] = {
        "ttft_model_ready": predictor.ttft_model is not None,
        "tpot_model_ready": predictor.tpot_model is not None,
    }

    if predictor.model_type == ModelType.BAYESIAN_RIDGE:
        info["model_status"]["ttft_coefficients_ready"] = predictor.ttft_coefficients is not None
        info["model_status"]["tpot_coefficients_ready"] = predictor.tpot_coefficients is not None

    # Add quantile-specific evaluation info
    info["evaluation_info"] = {
        "quantile_loss": "Pinball loss for quantile regression evaluation",
        "coverage_percent": f"Percentage of actual values below predicted {predictor.quantile:.0%} quantile (target: {predictor.quantile * 100:.1f}%)",
        "violation_rate_percent": f"Percentage of actual values above predicted {predictor.quantile:.0%} quantile (target: {(1 - predictor.quantile) * 100:.1f}%)",
    }

    return info


@app.get("/model/ttft/xgb/json")
async def ttft_xgb_json():
    """
    Dump the TTFT XGBoost model as JSON trees.
    """
    if predictor.model_type != ModelType.XGBOOST:
        raise HTTPException(status_code=404, detail="TTFT model is not XGBoost")

    if not predictor.ttft_model:
        raise HTTPException(status_code=404, detail="TTFT model not available")

    try:
        booster = predictor.ttft_model.get_booster()
        # get_dump with dump_format="json" gives one JSON string per tree
        raw_trees = booster.get_dump(dump_format="json")
        # parse each string into a dict so the response is a JSON array of objects
        trees = [json.loads(t) for t in raw_trees]
        return JSONResponse(content=trees)
    except Exception as e:
        logging.error(f"Error dumping TTFT XGBoost trees: {e}", exc_info=True)
        raise HTTPException(status_code=500, detail="Error dumping TTFT XGBoost trees")


@app.get("/model/tpot/xgb/json")
async def tpot_xgb_json():
    """
    Dump the TPOT XGBoost model as JSON trees.
    """
    if predictor.model_type != ModelType.XGBOOST:
        raise HTTPException(status_code=404, detail="TPOT model is not XGBoost")

    if not predictor.tpot_model:
        raise HTTPException(status_code=404, detail="TPOT model not available")

    try:
        booster = predictor.tpot_model.get_booster()
        raw_trees = booster.get_dump(dump_format="json")
        trees = [json.loads(t) for t in raw_trees]
        return JSONResponse(content=trees)
    except Exception as e:
        logging.error(f"Error dumping TPOT XGBoost trees: {e}", exc_info=True)
        raise HTTPException(status_code=500, detail="Error dumping TPOT XGBoost trees")


@app.get("/model/{model_name}/info")
async def model_info(model_name: str):
    """Get model file information including last modified time."""
    model_paths = _get_model_paths()

    if model_name not in model_paths:
        raise HTTPException(status_code=404, detail=f"Unknown model: {model_name}")

    model_path = model_paths[model_name]

    if not os.path.exists(model_path):
        raise HTTPException(status_code=404, detail=f"Model {model_name} not found")

    # Get file stats
    stat = os.stat(model_path)
    last_modified = datetime.fromtimestamp(stat.st_mtime, tz=UTC)

    return {
        "model_name": model_name,
        "path": model_path,
        "size_bytes": stat.st_size,
        "last_modified": last_modified.isoformat(),
        "exists": True,
        "model_type": predictor.model_type.value,
        "quantile": predictor.quantile if model_name in ["ttft", "tpot"] else None,
    }


@app.get("/model/{model_name}/download")
async def download_model(model_name: str):
    """Download a model file."""
    model_paths = _get_model_paths()

    if model_name not in model_paths:
        raise HTTPException(status_code=404, detail=f"Unknown model: {model_name}")

    model_path = model_paths[model_name]

    if not os.path.exists(model_path):
        raise HTTPException(status_code=404, detail=f"Model {model_name} not found")

    # Return the file
    filename = f"{model_name}.joblib"
    return FileResponse(model_path, media_type="application/octet-stream", filename=filename)


@app.get("/models/list")
async def list_models():
    """List all available models with their status."""
    models = {}
    model_paths = _get_model_paths()

    for model_name, model_path in model_paths.items():
        if os.path.exists(model_path):
            stat = os.stat(model_path)
            models[model_name] = {
                "exists": True,
                "size_bytes": stat.st_size,
                "last_modified": datetime.fromtimestamp(stat.st_mtime, tz=UTC).isoformat(),
            }
        else:
            models[model_name] = {"exists": False, "size_bytes": 0, "last_modified": None}

    return {
        "models": models,
        "model_type": predictor.model_type.value,
        "quantile": predictor.quantile,
        "server_time": datetime.now(UTC).isoformat(),
        "evaluation_metrics": {
            "quantile_loss": "Lower is better",
            "coverage_percent": f"Target: {predictor.quantile * 100:.1f}%",
            "violation_rate_percent": f"Target: {(1 - predictor.quantile) * 100:.1f}%",
        },
    }


# Add new API endpoints for LightGBM model exports
@app.get("/model/ttft/lgb/txt")
async def ttft_lgb_txt():
    """
    Download the TTFT LightGBM model as text format.
    """
    if predictor.model_type != ModelType.LIGHTGBM:
        raise HTTPException(status_code=404, detail="TTFT model is not LightGBM")

    if not predictor.ttft_model:
        raise HTTPException(status_code=404, detail="TTFT model not available")

    txt_path = settings.TTFT_MODEL_PATH.replace(".joblib", "_lgb.txt")
    if not os.path.exists(txt_path):
        raise HTTPException(status_code=404, detail="TTFT LightGBM text model not found")

    return FileResponse(txt_path, media_type="text/plain", filename="ttft_lgb_model.txt")


@app.get("/model/tpot/lgb/txt")
async def tpot_lgb_txt():
    """
    Download the TPOT LightGBM model as text format.
    """
    if predictor.model_type != ModelType.LIGHTGBM:
        raise HTTPException(status_code=404, detail="TPOT model is not LightGBM")

    if not predictor.tpot_model:
        raise HTTPException(status_code=404, detail="TPOT model not available")

    txt_path = settings.TPOT_MODEL_PATH.replace(".joblib", "_lgb.txt")
    if not os.path.exists(txt_path):
        raise HTTPException(status_code=404, detail="TPOT LightGBM text model not found")

    return FileResponse(txt_path, media_type="text/plain", filename="tpot_lgb_model.txt")


@app.get("/model/ttft/lgb/importances")
async def ttft_lgb_importances():
    """
    Get TTFT LightGBM feature importances as JSON.
    """
    if predictor.model_type != ModelType.LIGHTGBM:
        raise HTTPException(status_code=404, detail="TTFT model is not LightGBM")

    if not predictor.ttft_model:
        raise HTTPException(status_code=404, detail="TTFT model not available")

    imp_path = settings.TTFT_MODEL_PATH.replace(".joblib", "_importances.json")
    if not os.path.exists(imp_path):
        raise HTTPException(status_code=404, detail="TTFT LightGBM importances not found")

    with open(imp_path) as f:
        importances = json.load(f)

    return JSONResponse(content=importances)


@app.get("/model/tpot/lgb/importances")
async def tpot_lgb_importances():
    """
    Get TPOT LightGBM feature importances as JSON.
    """
    if predictor.model_type != ModelType.LIGHTGBM:
        raise HTTPException(status_code=404, detail="TPOT model is not LightGBM")

    if not predictor.tpot_model:
        raise HTTPException(status_code=404, detail="TPOT model not available")

    imp_path = settings.TPOT_MODEL_PATH.replace(".joblib", "_importances.json")
    if not os.path.exists(imp_path):
        raise HTTPException(status_code=404, detail="TPOT LightGBM importances not found")

    with open(imp_path) as f:
        importances = json.load(f)

    return JSONResponse(content=importances)


@app.get("/debug/prefix_distribution")
async def prefix_distribution():
    """
    Debug endpoint to analyze the relationship between prefix_cache_score and TTFT.
    This helps verify that the model is seeing the data it needs to learn.
    """
    all_samples = predictor._all_samples(predictor.ttft_data_buckets)
    if not all_samples:
        return {"error": "No training samples available"}

    prefix_scores = [s["prefix_cache_score"] for s in all_samples]
    ttfts = [s["actual_ttft_ms"] for s in all_samples]

    # Group by prefix score ranges
    ranges = [(0, 0.25), (0.25, 0.5), (0.5, 0.75), (0.75, 1.0)]
    distribution = {}

    for low, high in ranges:
        # include the right edge only for the final bin so 1.0 is counted
        mask = [low <= p <= high for p in prefix_scores] if high == 1.0 else [low <= p < high for p in prefix_scores]

        range_ttfts = [t for t, m in zip(ttfts, mask) if m]
        range_prefix = [p for p, m in zip(prefix_scores, mask) if m]
        distribution[f"{low}-{high}"] = {
            "count": len(range_ttfts),
            "mean_ttft_ms": float(np.mean(range_ttfts)) if range_ttfts else 0,
            "median_ttft_ms": float(np.median(range_ttfts)) if range_ttfts else 0,
            "std_ttft_ms": float(np.std(range_ttfts)) if range_ttfts else 0,
            "mean_prefix_score": float(np.mean(range_prefix)) if range_prefix else 0,
            "min_ttft_ms": float(np.min(range_ttfts)) if range_ttfts else 0,
            "max_ttft_ms": float(np.max(range_ttfts)) if range_ttfts else 0,
        }

    # Overall statistics
    overall = {
        "total_samples": len(all_samples),
        "prefix_score_mean": float(np.mean(prefix_scores)),
        "prefix_score_std": float(np.std(prefix_scores)),
        "prefix_score_min": float(np.min(prefix_scores)),
        "prefix_score_max": float(np.max(prefix_scores)),
        "ttft_mean": float(np.mean(ttfts)),
        "ttft_std": float(np.std(ttfts)),
        "correlation": float(np.corrcoef(prefix_scores, ttfts)[0, 1]),
    }

    return {
        "overall_stats": overall,
        "distribution_by_prefix_range": distribution,
        "interpretation": {
            "correlation": "Negative correlation means higher prefix score → lower TTFT (good!)",
            "check_distribution": "All ranges should have samples. Empty ranges mean missing data.",
            "expected_pattern": "TTFT should decrease significantly as prefix score increases",
        },
    }


if __name__ == "__main__":
    uvicorn.run("__main__:app", host="0.0.0.0", port=8000, reload=True)
