from django.contrib import admin
from django.urls import path

from . import views

urlpatterns = [
    path("", views.home, name="home"),
    path("buy/", views.buy, name="buy"),
    path("experiment/", views.experiment, name="experiment"),
    path("restock/", views.restock, name="restock"),
    path("sync/", views.sync, name="sync"),
    path("admin/", admin.site.urls),
]
