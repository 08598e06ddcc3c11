"""TorchServe inference only (what `ringserve router` serves), from stubs compiled from TorchServe's protos.

    python ts_predict.py STUB_DIR HOST:PORT MODEL PROMPT MAX_NEW_TOKENS

Prints one JSON object: ping, the Predictions text and the StreamPredictions chunks of one greedy request.
"""

from __future__ import annotations

import json
import sys

import grpc
from google.protobuf import empty_pb2

sys.path.insert(0, sys.argv[1])
import inference_pb2
import inference_pb2_grpc


def main() -> None:
    address, model, prompt, max_new_tokens = sys.argv[2], sys.argv[3], sys.argv[4], int(sys.argv[5])
    with grpc.insecure_channel(address) as channel:
        inference = inference_pb2_grpc.InferenceAPIsServiceStub(channel)
        body = json.dumps({"prompt": prompt, "max_new_tokens": max_new_tokens, "temperature": 0}).encode()
        request = inference_pb2.PredictionsRequest(model_name=model, input={"data": body})
        print(json.dumps({
            "ping": json.loads(inference.Ping(empty_pb2.Empty(), timeout=30).health),
            "prediction": inference.Predictions(request, timeout=300).prediction.decode(),
            "stream_chunks": [r.prediction.decode() for r in inference.StreamPredictions(request, timeout=300)],
        }))  # fmt: skip


if __name__ == "__main__":
    main()
