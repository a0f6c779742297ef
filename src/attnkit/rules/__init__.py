"""What every backend obeys, written once: the rule for non-finite values
([`nonfinite`][attnkit.rules.nonfinite]), learned sinks joined through the log-sum-exp
([`sinks`][attnkit.rules.sinks]), dropout's counter-based mask ([`dropout`][attnkit.rules.dropout]),
and the float64 equations that are the oracle of every test ([`exact`][attnkit.rules.exact]).
"""
