"""One TorchServe management or inference call, made with stubs compiled only from TorchServe's protos.

Usage: ts_manage.py STUB_DIR ADDRESS ACTION [ARG ...]; prints {"ok": <reply>} or {"error": "CODE: details"} as JSON.
Actions: list; describe NAME; register NAME URL WORKERS; scale NAME N; set_default NAME; unregister NAME;
predict NAME PROMPT.
"""

from __future__ import annotations

import json
import sys
from collections.abc import Callable
from typing import Any

import grpc

sys.path.insert(0, sys.argv[1])
import inference_pb2
import inference_pb2_grpc
import management_pb2
import management_pb2_grpc


def main() -> None:
    channel = grpc.insecure_channel(sys.argv[2])
    management = management_pb2_grpc.ManagementAPIsServiceStub(channel)
    inference = inference_pb2_grpc.InferenceAPIsServiceStub(channel)
    action, args = sys.argv[3], sys.argv[4:]

    def msg(reply: Any) -> Any:
        return json.loads(reply.msg)

    calls: dict[str, Callable[[], Any]] = {
        "list": lambda: msg(management.ListModels(management_pb2.ListModelsRequest(), timeout=30)),
        "describe": lambda: msg(management.DescribeModel(
            management_pb2.DescribeModelRequest(model_name=args[0]), timeout=30)),
        "register": lambda: msg(management.RegisterModel(management_pb2.RegisterModelRequest(
            model_name=args[0], url=args[1], initial_workers=int(args[2]), synchronous=True), timeout=300)),
        "scale": lambda: msg(management.ScaleWorker(management_pb2.ScaleWorkerRequest(
            model_name=args[0], min_worker=int(args[1]), synchronous=True), timeout=300)),
        "set_default": lambda: msg(management.SetDefault(
            management_pb2.SetDefaultRequest(model_name=args[0]), timeout=30)),
        "unregister": lambda: msg(management.UnregisterModel(
            management_pb2.UnregisterModelRequest(model_name=args[0]), timeout=120)),
        "predict": lambda: inference.Predictions(inference_pb2.PredictionsRequest(
            model_name=args[0], input={"data": json.dumps(
                {"prompt": args[1], "max_new_tokens": 8, "temperature": 0}).encode()}),
            timeout=120).prediction.decode(),
    }
    try:
        print(json.dumps({"ok": calls[action]()}))
    except grpc.RpcError as err:
        print(json.dumps({"error": f"{err.code().name}: {err.details()}"}))


if __name__ == "__main__":
    main()
