"""Run a GGUF file in llama.cpp (the xllamacpp wheel, on the CPU): greedy tokens and the top
log-probabilities of each, for a prompt given as token ids. Runs inside the xllamacpp venv
(tests/gguf_env.py), so it imports nothing of streamck's or the tests'.

usage: python gguf_llama.py MODEL.gguf '[1, 2, 3]' N_PREDICT N_PROBS  -> JSON on stdout:
{"tokens": [...], "top": [[[id, logprob], ...], ...]}
MODEL.gguf may be a JSON list of files, run one after another in this one process (llama.cpp's
start-up paid once): then the JSON is a list of those objects, in the same order.
"""

import json
import sys

import xllamacpp as xlc


def main() -> None:
    model, prompt, n_predict, n_probs = sys.argv[1], json.loads(sys.argv[2]), int(sys.argv[3]), int(sys.argv[4])
    if model.startswith("["):
        print(json.dumps([run(m, prompt, n_predict, n_probs) for m in json.loads(model)]))
    else:
        print(json.dumps(run(model, prompt, n_predict, n_probs)))


def run(model: str, prompt: list, n_predict: int, n_probs: int) -> dict:
    params = xlc.CommonParams()
    params.model.path = model
    params.n_ctx = 256
    params.n_parallel = 1
    params.cpuparams.n_threads = 2
    params.flash_attn_type = xlc.llama_flash_attn_type.LLAMA_FLASH_ATTN_TYPE_DISABLED
    params.cache_type_k = params.cache_type_v = (
        xlc.ggml_type.GGML_TYPE_F32
    )  # the KV cache in f16 would be the largest error
    server = xlc.Server(params)
    result = server.handle_completions(
        {
            "prompt": prompt,
            "n_predict": n_predict,
            "temperature": 0.0,
            "top_k": 1,
            "n_probs": n_probs,
            "post_sampling_probs": False,
            "cache_prompt": False,
            "return_tokens": True,
        }
    )
    if "error" in result:
        raise SystemExit(json.dumps(result["error"]))
    steps = result["choices"][0]["logprobs"]["content"]
    top = [[[p["id"], p["logprob"]] for p in step["top_logprobs"]] for step in steps]
    return {"tokens": [step["id"] for step in steps], "top": top}


if __name__ == "__main__":
    main()
