"""A TorchServe gRPC client built only from TorchServe's protos (compiled by the test into argv[1]).

Runs every scenario against the server at argv[2] and prints the observations as one JSON object.
"""

from __future__ import annotations

import json
import sys

import grpc
from google.protobuf import empty_pb2

sys.path.insert(0, sys.argv[1])
import inference_pb2
import inference_pb2_grpc
import management_pb2
import management_pb2_grpc


def body(payload: dict) -> dict[str, bytes]:
    return {"data": json.dumps(payload).encode()}


def error_code(call) -> str:
    try:
        call()
    except grpc.RpcError as err:
        return f"{err.code().name}: {err.details()}"
    return "OK"


def main() -> None:
    channel = grpc.insecure_channel(sys.argv[2])
    inference = inference_pb2_grpc.InferenceAPIsServiceStub(channel)
    management = management_pb2_grpc.ManagementAPIsServiceStub(channel)
    model = sys.argv[3]
    greedy = {"prompt": "The capital of France is", "max_new_tokens": 8, "temperature": 0}
    out: dict = {"ping": json.loads(inference.Ping(empty_pb2.Empty(), timeout=30).health)}
    request = inference_pb2.PredictionsRequest(model_name=model, input=body(greedy))
    out["prediction"] = inference.Predictions(request, timeout=120).prediction.decode()
    out["stream_chunks"] = [r.prediction.decode() for r in inference.StreamPredictions(request, timeout=120)]
    raw = inference_pb2.PredictionsRequest(model_name=model, input={"body": b"Hello"})
    out["raw_text_prediction"] = inference.Predictions(raw, timeout=600).prediction.decode()
    bidi = [
        inference_pb2.PredictionsRequest(model_name=model, input=body(greedy), sequenceId="a"),
        inference_pb2.PredictionsRequest(model_name=model, input=body({"prompt": "x", "max_new_tokens": -1}),
                                         sequenceId="b"),
    ]
    out["bidi"] = [
        {"seq": r.sequenceId, "text": r.prediction.decode(), "status": r.status.code if r.HasField("status") else 0,
         "message": r.status.message}
        for r in inference.StreamPredictions2(iter(bidi), timeout=120)
    ]
    out["unknown_model"] = error_code(lambda: inference.Predictions(
        inference_pb2.PredictionsRequest(model_name="nope", input=body(greedy)), timeout=30))
    out["missing_data"] = error_code(lambda: inference.Predictions(
        inference_pb2.PredictionsRequest(model_name=model, input={"other": b"x"}), timeout=30))
    out["bad_temperature"] = error_code(lambda: inference.Predictions(
        inference_pb2.PredictionsRequest(model_name=model, input=body({"prompt": "x", "temperature": "hot"})),
        timeout=30))
    out["list_models"] = json.loads(management.ListModels(management_pb2.ListModelsRequest(), timeout=30).msg)
    out["describe"] = json.loads(management.DescribeModel(
        management_pb2.DescribeModelRequest(model_name=model), timeout=30).msg)
    out["register_missing"] = error_code(lambda: management.RegisterModel(
        management_pb2.RegisterModelRequest(url="/nonexistent/x.gguf", model_name="x", synchronous=True), timeout=30))
    out["register_remote"] = error_code(lambda: management.RegisterModel(
        management_pb2.RegisterModelRequest(url="https://example.com/x.gguf", model_name="x"), timeout=30))
    out["unregister_unknown"] = error_code(lambda: management.UnregisterModel(
        management_pb2.UnregisterModelRequest(model_name="nope"), timeout=30))
    out["list_models_after"] = json.loads(management.ListModels(management_pb2.ListModelsRequest(), timeout=30).msg)
    print(json.dumps(out))


if __name__ == "__main__":
    main()
