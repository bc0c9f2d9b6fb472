;;;; package.lisp -- the GALLOP-TESTS package.

(defpackage #:gallop-tests
  (:use #:common-lisp #:fiveam)
  (:shadow #:run-all-tests)
  (:export #:run-all-tests #:main #:check-hunchentoot-version))
