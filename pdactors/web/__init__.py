"""HTTP serving shared by the bootstrap and the proxy: hypercorn under trio on a listener we
bind (``_server``), Quart helpers for JSON answers, the bearer gate and error handlers
(``_app``), the constant-time bearer check (``_auth``) and the once-per-interval log of refused
clients (``_refusals``)."""

from pdactors.web._app import client_address as client_address
from pdactors.web._app import guard as guard
from pdactors.web._app import json_response as json_response
from pdactors.web._auth import BearerCheck as BearerCheck
from pdactors.web._refusals import RefusalLog as RefusalLog
from pdactors.web._server import bind_listener as bind_listener
from pdactors.web._server import serve_http as serve_http
