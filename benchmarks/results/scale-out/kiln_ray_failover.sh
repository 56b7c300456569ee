set -e
# kiln ray on a cluster of a head and 2 worker nodes on this machine (modelkiln.ray.local_cluster, the
# `ray start` commands below with their own ports), a chat model and an embedding model x 2 replicas;
# a stream whose replica's node is killed mid-answer goes on, and ends as the same request alone does.
# Usage: kiln_ray_failover.sh CHAT_ARTIFACT EMBEDDINGS_ARTIFACT  (output: kiln_ray_failover.txt)
cd "$(dirname "$0")/../../.."; export PYTHONPATH=$PWD/src; PY=${PYTHON:-python}
$PY - "$1" "$2" <<'PY'
import json, sys, time, httpx
from modelkiln.ray.local_cluster import LocalCluster
from modelkiln.ray.process import RayProcess

chat, emb = sys.argv[1], sys.argv[2]
cluster = LocalCluster(workers=2, cpus_per_worker=2, timeout=300)
try:
    print(f"$ ray start --head --port {cluster.gcs_port} --num-cpus 0 ...          # the head: no CPU for replicas")
    print(f"$ ray start --address {cluster.address} --num-cpus 2 ...   # x 2 worker nodes")
    args = [f"chat={chat}", f"emb={emb}", "--replicas", "2", "--max-replicas-per-node", "1", "--address", cluster.address]
    print("$ kiln ray " + " ".join(args).replace(cluster.address, "127.0.0.1:" + str(cluster.gcs_port)))
    server = RayProcess(args, timeout=600)
    try:
        print("\n".join(line for line in server.output().splitlines() if line.startswith(("✓", "Serving"))))
        for r in cluster.replicas():
            print(f"  replica {r.id} of {r.app} on {r.node.name}")
        body = {"model": "chat", "messages": [{"role": "user", "content": "Give me a short tip for better sleep."}],
                "max_tokens": 96, "ignore_eos": True, "temperature": 0.8, "return_token_ids": True, "stream": True}
        print(f"\n$ curl -sN -i {server.url}/v1/chat/completions -d '{json.dumps(body)}'")
        ids, text, killed, seed = [], "", None, None
        with httpx.stream("POST", server.url + "/v1/chat/completions", json=body, timeout=300) as response:
            replica = response.headers["x-kiln-replica"]
            print(f"HTTP/1.1 {response.status_code}\nx-kiln-replica: {replica}")
            for line in response.iter_lines():
                if not line.startswith("data: {"):
                    if line == "data: [DONE]":
                        print(line)
                    continue
                event = json.loads(line[6:])
                if seed is None:
                    seed = event["seed"]
                    print(line[:160] + " ...")
                for choice in event["choices"]:
                    ids += choice.get("token_ids", [])
                    text += choice["delta"].get("content") or ""
                if len(ids) >= 20 and killed is None:
                    node = next(r.node for r in cluster.replicas() if r.id == replica)
                    cluster.kill(node)
                    killed = time.monotonic()
                    print(f"... {len(ids)} tokens in: SIGKILL to every process of {node.name} (its raylet, its "
                          f"replicas) ...")
        print(f"({len(ids)} tokens in all, the stream's connection never closed)")
        alone = httpx.post(server.url + "/v1/chat/completions", timeout=300, json={
            **{k: v for k, v in body.items() if k != "stream"}, "seed": seed}).json()
        print(f"$ the same request with \"seed\": {seed}, not streamed, after the kill:")
        print(f"  same token ids: {alone['choices'][0]['token_ids'] == ids}, same text: "
              f"{alone['choices'][0]['message']['content'] == text}")
        print(f"$ curl -s {server.url}/metrics | grep -E '^kiln_(retries|streams_resumed|failovers_failed)_total'")
        print("\n".join(line for line in httpx.get(server.url + "/metrics").text.splitlines()
                        if line.startswith(("kiln_retries_total{", "kiln_streams_resumed_total{",
                                            "kiln_failovers_failed_total{"))))
    finally:
        server.stop()
finally:
    cluster.stop()
PY
