"""Each request of a `pdserve bench turns` result: conversation, turn, when sent, TTFT, path, pdserve's phase
timings and the prompt tokens served from a cache. Usage: python3 turns.py ratio--turns.json"""
import json, sys
d = json.load(open(sys.argv[1]))
run = d['runs'][0]
recs = run.get('records') or run.get('requests')
recs = sorted(recs, key=lambda r: (r['turn'], r['start_s']))
for r in recs:
    t = r.get('timings') or {}
    print('c%d t%d start %6.2f ttft %.2f path %-6s q %.2f pf %.2f tr %.2f cached %5s prompt %d' % (
        r['conversation'], r['turn'], r['start_s'], r['ttft_s'], t.get('path'), t.get('queue_s', 0),
        t.get('prefill_s', 0), t.get('transfer_s', 0), r.get('cached_tokens'), r['prompt_tokens']))
