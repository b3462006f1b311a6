#!/usr/bin/env python3
"""Stream one answer over HTTP: Triton's generate_stream endpoint (server-sent events).

    python client_examples/http_generate_stream.py "Why is the sky blue?" --url http://127.0.0.1:8000

Standard library only. Each event is ``data: {"text_output": "...", ...}``; an error arrives as
``data: {"error": "..."}``. ``--no-stream`` uses the one-shot ``generate`` endpoint instead.
"""

import argparse
import json
import sys
import urllib.error
import urllib.request


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("prompt", nargs="?", default="Why is the sky blue?")
    ap.add_argument("--url", default="http://127.0.0.1:8000")
    ap.add_argument("--model", default="slipstream")
    ap.add_argument("--max-tokens", type=int, default=128)
    ap.add_argument("--temperature", type=float, default=0.0)
    ap.add_argument("--raw", action="store_true", help="do not apply the chat template")
    ap.add_argument("--no-stream", action="store_true", help="use /generate (one response)")
    args = ap.parse_args()

    body = {
        "text_input": args.prompt,
        "stream": not args.no_stream,
        "parameters": {
            "max_tokens": args.max_tokens,
            "temperature": args.temperature,
            "apply_chat_template": not args.raw,
            "return_finish_reason": True,
        },
    }
    if args.no_stream:
        body["exclude_input_in_output"] = True
    endpoint = "generate" if args.no_stream else "generate_stream"
    request = urllib.request.Request(
        f"{args.url}/v2/models/{args.model}/{endpoint}",
        data=json.dumps(body).encode(),
        headers={"Content-Type": "application/json"},
    )
    finish_reason = None
    try:
        with urllib.request.urlopen(request, timeout=600) as response:
            if args.no_stream:
                data = json.loads(response.read())
                print(data["text_output"])
                finish_reason = data.get("finish_reason")
            else:
                for line in response:  # server-sent events, one "data: {...}" line each
                    line = line.decode("utf-8").strip()
                    if not line.startswith("data:"):
                        continue
                    event = json.loads(line[len("data:") :])
                    if "error" in event:
                        print(f"\nerror: {event['error']}", file=sys.stderr)
                        return 1
                    sys.stdout.write(event.get("text_output", ""))
                    sys.stdout.flush()
                    finish_reason = event.get("finish_reason") or finish_reason
                print()
    except urllib.error.HTTPError as e:
        print(f"error {e.code}: {e.read().decode()}", file=sys.stderr)
        return 1
    print(f"[finish_reason={finish_reason}]")
    return 0


if __name__ == "__main__":
    sys.exit(main())
