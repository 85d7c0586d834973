"""The transformers side of ``rigctl check``: a standalone script, run with whichever Python has
transformers and torch (rigctl's own venv need not), reading one JSON request on stdin and writing
one JSON answer on stdout.

    {"op": "render", "checkout": DIR, "conversations": [{"messages": [...], "tools": [...] | null}],
     "chat_template": TEXT | null, "template_kwargs": {...}}
        -> {"prompts": [TEXT, ...]}
    {"op": "logits", "checkout": DIR, "prompts": [[token id, ...], ...], "candidates": [[id, ...], ...],
     "top_k": K}
        -> {"results": [{"top": [[id, logprob], ...], "candidates": {id: logprob}}, ...]}

Logits come from the checkout's model in float32 on the CPU: the reference the served GGUF files are
measured against. Only the standard library is imported before the request says what is needed,
and a missing package exits 3 with a one-line reason on stderr.
"""

import json
import sys

MISSING = 3


def _need(module: str):
    try:
        return __import__(module)
    except ImportError:
        print(f"{module} is not installed for {sys.executable}", file=sys.stderr)
        sys.exit(MISSING)


def render(request: dict) -> dict:
    _need("transformers")
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(request["checkout"])
    kwargs = dict(request.get("template_kwargs") or {})
    if request.get("chat_template"):
        kwargs["chat_template"] = request["chat_template"]
    prompts = []
    for conversation in request["conversations"]:
        prompts.append(tokenizer.apply_chat_template(conversation["messages"], tools=conversation.get("tools"),
                                                     tokenize=False, add_generation_prompt=True, **kwargs))
    return {"prompts": prompts}


def logits(request: dict) -> dict:
    torch = _need("torch")
    _need("transformers")
    from transformers import AutoModelForCausalLM

    torch.manual_seed(0)
    # Loaded in the checkpoint's dtype, then widened: the same weights, computed in float32.
    model = AutoModelForCausalLM.from_pretrained(request["checkout"]).to(torch.float32)
    model.eval()
    top_k = int(request["top_k"])
    results = []
    with torch.no_grad():
        for ids, candidates in zip(request["prompts"], request["candidates"], strict=True):
            out = model(torch.tensor([ids], dtype=torch.long))
            logprobs = torch.log_softmax(out.logits[0, -1].to(torch.float32), dim=-1)
            values, indices = torch.topk(logprobs, top_k)
            results.append({
                "top": [[int(i), float(v)] for i, v in zip(indices.tolist(), values.tolist(), strict=True)],
                "candidates": {str(int(c)): float(logprobs[int(c)]) for c in candidates},
            })
    return {"results": results}


def main() -> None:
    request = json.load(sys.stdin)
    ops = {"render": render, "logits": logits}
    if request.get("op") not in ops:
        print(f"unknown op {request.get('op')!r}", file=sys.stderr)
        sys.exit(2)
    json.dump(ops[request["op"]](request), sys.stdout)


if __name__ == "__main__":
    main()
