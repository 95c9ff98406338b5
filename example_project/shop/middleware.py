import threading
from collections.abc import Callable

from django.http import HttpRequest, HttpResponse


def name_the_thread(
    get_response: Callable[[HttpRequest], HttpResponse],
) -> Callable[[HttpRequest], HttpResponse]:
    """runserver answers each request in a thread of its own, "Thread-7
    (process_request_thread)": named "web request", the locks it takes say who holds them."""

    def middleware(request: HttpRequest) -> HttpResponse:
        threading.current_thread().name = "web request"
        return get_response(request)

    return middleware
