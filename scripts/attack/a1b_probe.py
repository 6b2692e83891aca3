import asyncio
import socket
import time
from common import *
async def main(c, key):
    a = await Conn.open(c.edge_urls["e1"], key)
    m = '"messages":[{"role":"user","content":"hi"}]'
    for label, raw in [("max_tokens 1e23 int", '{"type":"chat","id":"n1",%s,"max_tokens":99999999999999999999999}' % m),
                       ("seed 2^64", '{"type":"chat","id":"n2",%s,"seed":18446744073709551616}' % m),
                       ("float 1e400", '{"type":"chat","id":"n3",%s,"temperature":1e400}' % m),
                       ("Infinity", '{"type":"chat","id":"n4",%s,"temperature":Infinity}' % m),
                       ("last_seq 2^40", '{"type":"resume","id":"n5","last_seq":1099511627776}'),
                       ("dup keys", '{"type":"chat","id":"n6","id":"n7",%s,"max_tokens":3}' % m)]:
        n = len(a.raw); await a.send(raw); await asyncio.sleep(0.3)
        print(label, "->", [strip(f) for f in a.raw[n:]][:2])
    await a.close()
def raw_http(c, key):
    s = socket.create_connection(("127.0.0.1", c.edge_ports["e1"]), timeout=10)
    s.sendall(f"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\nAuthorization: Bearer {key}\r\nContent-Type: application/json\r\nContent-Length: 5000000\r\n\r\n".encode())
    time.sleep(0.5)
    s.setblocking(False)
    try: print("before body, server sent:", s.recv(300)[:120])
    except BlockingIOError: print("before body: nothing yet")
    s.setblocking(True)
    sent = 0
    try:
        for _ in range(80):
            s.sendall(b"a" * 65536); sent += 65536
    except OSError as e: print("send error after", sent, e)
    try: print("after body:", s.recv(300)[:120])
    except OSError as e: print("recv error", e)
if __name__ == "__main__":
    c, tmp = start_cluster("a1b")
    try:
        key = create_key(c, "alice")
        asyncio.run(main(c, key)); raw_http(c, key)
    finally: c.close()
