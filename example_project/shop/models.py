"""The oversell experiment's tickets, in the shop's database (SQLite, or PostgreSQL with
``DATABASE_URL``): one row per way of selling, and a row per sale."""

from django.db import models


class Ticket(models.Model):
    """One run of the experiment: ``seats`` on sale, ``left`` of them by the shop's count."""

    way = models.CharField(max_length=20, unique=True)  # see experiment.WAYS
    seats = models.PositiveIntegerField()
    left = models.IntegerField()
    failed = models.PositiveIntegerField(default=0)  # purchases the database refused
    ran_at = models.DateTimeField(auto_now=True)

    def __str__(self) -> str:
        return f"{self.way}: {self.left} of {self.seats} left"


class Sale(models.Model):
    """A sale the buyer was told went through: committed, with the stock it read."""

    ticket = models.ForeignKey(Ticket, models.CASCADE, related_name="sales")
    seen = models.IntegerField()  # the seats left when this buyer read them

    def __str__(self) -> str:
        return f"sale of {self.ticket.way} (saw {self.seen} left)"
