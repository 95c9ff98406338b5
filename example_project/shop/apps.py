from django.apps import AppConfig


class ShopConfig(AppConfig):
    name = "shop"
    default_auto_field = "django.db.models.BigAutoField"

    def ready(self) -> None:
        from django_redlock.contrib.celery import duplicate_skipped
        from django_redlock.signals import lock_acquired

        from .live import record_handoff, record_skipped

        lock_acquired.connect(record_handoff, dispatch_uid="shop.handoffs")
        duplicate_skipped.connect(record_skipped, dispatch_uid="shop.skipped")
