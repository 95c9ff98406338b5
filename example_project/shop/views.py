from django.http import HttpRequest, HttpResponse
from django.shortcuts import redirect, render
from django.views.decorators.http import require_POST

from django_redlock import LockNotAcquired, lock, lock_view

from . import stock, tasks


def home(request: HttpRequest) -> HttpResponse:
    return render(request, "shop/home.html", {"left": stock.left()})


@require_POST
@lock_view("buyer:{request.META[REMOTE_ADDR]}", timeout=0)  # a double click answers 409
def buy(request: HttpRequest) -> HttpResponse:
    try:
        with lock("tickets", timeout=2) as held:
            sold = stock.sell_one()
            fence = held.fence
    except LockNotAcquired:
        return HttpResponse("The ticket desk is busy, try again.", status=409)
    message = f"Ticket bought (fencing token {fence})." if sold else "Sold out."
    return render(request, "shop/home.html", {"left": stock.left(), "message": message})


def experiment(request: HttpRequest) -> HttpResponse:
    if request.method != "POST":
        return render(request, "shop/experiment.html", {})
    results = [
        ("without a lock", stock.run_experiment(50, 8, 10, locked=False)),
        ("with django-redlock", stock.run_experiment(50, 8, 10, locked=True)),
    ]
    stock.restock(100)
    return render(request, "shop/experiment.html", {"results": results})


@require_POST
def restock(request: HttpRequest) -> HttpResponse:
    stock.restock(100)
    return redirect("home")


@require_POST
def sync(request: HttpRequest) -> HttpResponse:
    """Start the nightly sync twice at once: the second one is skipped, not run twice."""
    first = tasks.nightly_sync.delay(3.0)
    second = tasks.nightly_sync.delay(3.0)
    message = f"Sync tasks {first.id} and {second.id} sent; only one of them runs."
    return render(request, "shop/home.html", {"left": stock.left(), "message": message})
