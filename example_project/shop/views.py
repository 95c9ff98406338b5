from django.contrib import messages
from django.http import HttpRequest, HttpResponse, JsonResponse
from django.shortcuts import redirect, render
from django.views.decorators.http import require_POST

from django_redlock import LockNotAcquired, lock, lock_view

from . import experiment as oversell
from . import live, stock, tasks


def home(request: HttpRequest) -> HttpResponse:
    return render(request, "shop/home.html", {"live": live.snapshot()})


def live_json(request: HttpRequest) -> JsonResponse:
    """The live panel's data: held locks, the last hand-offs, the last experiment."""
    return JsonResponse(live.snapshot())


# Every POST answers with a redirect, so that reloading the page never sends it again.


@require_POST
@lock_view("buyer:{request.META[REMOTE_ADDR]}", timeout=0)  # a double click answers 409
def buy(request: HttpRequest) -> HttpResponse:
    try:
        with lock("tickets", timeout=2) as held:
            sold = stock.sell_one()
            fence = held.fence
    except LockNotAcquired:
        return HttpResponse("The ticket desk is busy, try again.", status=409)
    messages.info(request, f"Ticket bought (fencing token {fence})." if sold else "Sold out.")
    return redirect("home")


def experiment(request: HttpRequest) -> HttpResponse:
    """The oversell experiment: a POST runs it (some seconds), then the page shows it."""
    if request.method != "POST":
        context = {"results": oversell.results(), "database": oversell.database()}
        return render(request, "shop/experiment.html", context)
    oversell.run_all()
    return redirect("experiment")


@require_POST
def move(request: HttpRequest) -> HttpResponse:
    """Move 10 tickets to the box office: both stocks locked together (lock_all)."""
    try:
        moved = stock.move_to_box_office(10)
    except LockNotAcquired:
        return HttpResponse("A sale or a move is under way, try again.", status=409)
    messages.info(
        request, f"{moved} tickets moved to the box office ({stock.box_office()} there now)."
    )
    return redirect("home")


@require_POST
def restock(request: HttpRequest) -> HttpResponse:
    stock.restock(100)
    messages.info(request, "The stock is back to 100 tickets.")
    return redirect("home")


@require_POST
def sync(request: HttpRequest) -> HttpResponse:
    """Start the nightly sync twice at once: the second one is skipped, not run twice."""
    first = tasks.nightly_sync.delay(3.0)
    second = tasks.nightly_sync.delay(3.0)
    messages.info(
        request, f"Sync tasks {first.id[:8]} and {second.id[:8]} sent; only one of them runs."
    )
    return redirect("home")


@require_POST
def desk(request: HttpRequest) -> HttpResponse:
    """Three Celery tasks queue for one fair lock: watch them take turns."""
    for clerk in range(1, 4):
        tasks.desk_shift.delay(clerk)
    messages.info(
        request, "Three clerks sent to the desk; they take turns, first come first served."
    )
    return redirect("home")
