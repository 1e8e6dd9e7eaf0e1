"""Makes the admin of a fresh Sluice server (as its first-run page does) and an API token of
theirs, and prints the token. Standard library only. Usage: admin_token.py BASE_URL"""

import http.cookiejar
import json
import sys
import urllib.request

base = sys.argv[1].rstrip("/")
opener = urllib.request.build_opener(urllib.request.HTTPCookieProcessor(http.cookiejar.CookieJar()))


def call(path, body=None, csrf=None):
    data = None if body is None else json.dumps(body).encode()
    headers = {"Content-Type": "application/json"}
    if csrf:
        headers["X-CSRF-Token"] = csrf
    request = urllib.request.Request(base + path, data=data, headers=headers)
    with opener.open(request, timeout=30) as reply:
        return json.load(reply)


# The session endpoint gives a visitor the CSRF token for the setup form.
session = call("/api/session")
session = call("/api/setup", {"username": "admin", "password": "openai client test"}, session["csrf"])
token = call("/api/account/tokens", {"name": "openai client test"}, session["csrf"])
print(token["token"])
