from django.contrib import admin
from django.urls import path

from . import views, views_exports

urlpatterns = [
    path("", views.home, name="home"),
    path("live.json", views.live_json, name="live"),
    path("buy/", views.buy, name="buy"),
    path("experiment/", views.experiment, name="experiment"),
    path("restock/", views.restock, name="restock"),
    path("sync/", views.sync, name="sync"),
    path("desk/", views.desk, name="desk"),
    path("exports/", views_exports.exports, name="exports"),
    path("admin/", admin.site.urls),
]
