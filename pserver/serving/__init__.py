"""A prediction server: `pserver serve-model DIR` answers a model file's predictions over gRPC
and HTTP/JSON, one model version per request, and follows a training job's delta exports.

    model    ServedModel: the model file mapped, its deltas applied between requests
    app      the gRPC and HTTP front ends, metrics, and serve_model (the command)
"""

from pserver.serving.app import ModelServer, ServeModelConfig, serve_model
from pserver.serving.model import ServedModel

__all__ = ["ModelServer", "ServeModelConfig", "ServedModel", "serve_model"]
