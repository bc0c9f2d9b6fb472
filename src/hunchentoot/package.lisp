;;;; package.lisp -- the GALLOP package: Gallop's drop-in classes for
;;;; Hunchentoot users.

(defpackage #:gallop
  (:use #:common-lisp)
  (:import-from #:gallop.core
                #:connection #:connection-mark-boundary #:connection-owner-stream
                #:connection-user-data #:connection-remote-address
                #:connection-remote-port #:connection-local-address
                #:connection-local-port)
  (:export #:acceptor
           #:easy-acceptor
           #:ssl-acceptor
           #:easy-ssl-acceptor
           #:taskmaster
           #:taskmaster-standby-thread-count
           #:taskmaster-max-queue-length
           #:taskmaster-engine
           #:stats))
