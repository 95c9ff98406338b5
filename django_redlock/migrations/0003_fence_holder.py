from django.db import migrations, models


class Migration(migrations.Migration):
    dependencies = [
        ("django_redlock", "0002_fence"),
    ]

    operations = [
        migrations.AddField(
            model_name="fence",
            name="holder",
            field=models.CharField(blank=True, max_length=64, null=True),
        ),
    ]
