from pathlib import Path

from django.contrib import admin
from django.urls import path
from django.views.static import serve

from . import views, views_exports

urlpatterns = [
    path("", views.home, name="home"),
    path("live.json", views.live_json, name="live"),
    path("buy/", views.buy, name="buy"),
    path("experiment/", views.experiment, name="experiment"),
    path("move/", views.move, name="move"),
    path("restock/", views.restock, name="restock"),
    path("sync/", views.sync, name="sync"),
    path("desk/", views.desk, name="desk"),
    path("exports/", views_exports.exports, name="exports"),
    path("admin/", admin.site.urls),
    # Browsers ask every page's server for it, the admin's pages too.
    path(
        "favicon.ico",
        serve,
        {"path": "favicon.ico", "document_root": Path(__file__).parent / "static/shop"},
    ),
]
