;;;; handlers.lisp -- the easy-handlers the Hunchentoot-layer tests serve.

(in-package #:gallop-tests)

(hunchentoot:define-easy-handler (handle-yo :uri "/yo") (name)
  (setf (hunchentoot:content-type*) "text/plain")
  (format nil "Hey~@[ ~A~]!" name))

(hunchentoot:define-easy-handler (handle-echo-params :uri "/params") (a b)
  (setf (hunchentoot:content-type*) "text/plain")
  (format nil "~(~A~) a=~A b=~A" (hunchentoot:request-method*) a b))

(hunchentoot:define-easy-handler (handle-echo-body :uri "/body") ()
  (setf (hunchentoot:content-type*) "application/octet-stream")
  (let ((data (hunchentoot:raw-post-data :force-binary t)))
    (format nil "~D:~A" (length data)
            (if data (map 'string #'code-char data) ""))))

(defparameter *big-size* (* 1024 1024))

(hunchentoot:define-easy-handler (handle-big :uri "/big") ()
  (setf (hunchentoot:content-type*) "application/octet-stream")
  (let ((data (make-array *big-size* :element-type '(unsigned-byte 8))))
    (dotimes (i *big-size*) (setf (aref data i) (mod i 251)))
    data))

(hunchentoot:define-easy-handler (handle-counter :uri "/counter") ()
  (setf (hunchentoot:content-type*) "text/plain")
  (hunchentoot:start-session)
  (let ((n (1+ (or (hunchentoot:session-value :n) 0))))
    (setf (hunchentoot:session-value :n) n)
    (hunchentoot:set-cookie "seen" :value (princ-to-string n) :path "/")
    (format nil "~D" n)))

(hunchentoot:define-easy-handler (handle-cookie-echo :uri "/cookie") ()
  (setf (hunchentoot:content-type*) "text/plain")
  (or (hunchentoot:cookie-in "flavour") "none"))

(defvar *sleep-seconds* 0.2)
(defvar *entered* nil "A semaphore signalled when /sleep starts, if bound.")
(defvar *release* nil
  "A semaphore /sleep waits on (at most 30 s) instead of sleeping, if bound.")

(hunchentoot:define-easy-handler (handle-sleepy :uri "/sleep") ()
  (when *entered* (sb-thread:signal-semaphore *entered*))
  (if *release*
      (sb-thread:wait-on-semaphore *release* :timeout 30)
      (sleep *sleep-seconds*))
  (setf (hunchentoot:content-type*) "text/plain")
  "slept")

(define-condition deliberate-error (error) ()
  (:report "deliberate test error"))

(hunchentoot:define-easy-handler (handle-fail :uri "/fail") ()
  (error 'deliberate-error))

(hunchentoot:define-easy-handler (handle-whoami :uri "/thread") ()
  (setf (hunchentoot:content-type*) "text/plain")
  (sb-thread:thread-name sb-thread:*current-thread*))

(hunchentoot:define-easy-handler (handle-chunked-out :uri "/chunked") ()
  (setf (hunchentoot:content-type*) "text/plain")
  (let ((stream (hunchentoot:send-headers)))
    (dotimes (i 5)
      (write-sequence (octets (format nil "part ~D;" i)) stream)
      (force-output stream))
    nil))

(defparameter *huge-chunk* (make-array (* 1024 1024) :element-type '(unsigned-byte 8)
                                                     :initial-element 120))

(hunchentoot:define-easy-handler (handle-huge :uri "/huge") ()
  (setf (hunchentoot:content-type*) "application/octet-stream"
        (hunchentoot:content-length*) (* 64 (length *huge-chunk*)))
  (let ((stream (hunchentoot:send-headers)))
    (dotimes (i 64) (write-sequence *huge-chunk* stream))
    nil))

(hunchentoot:define-easy-handler (handle-stream-body :uri "/stream-body") ()
  (setf (hunchentoot:content-type*) "text/plain")
  (let ((stream (hunchentoot:raw-post-data :want-stream t)))
    (princ-to-string (loop while (read-byte stream nil nil) count t))))

(hunchentoot:define-easy-handler (handle-detach :uri "/detach") ()
  (setf (hunchentoot:content-type*) "text/plain"
        (hunchentoot:content-length*) 4)
  (let ((stream (hunchentoot:send-headers)))
    (hunchentoot:detach-socket hunchentoot:*acceptor*)
    (sb-thread:make-thread
     (lambda ()
       (ignore-errors
        (sleep 0.2)
        (write-sequence (octets "late") stream)
        (finish-output stream)
        (close stream)))
     :name "detached writer"))
  nil)

(defun echo-a-line (stream)
  "Read a line from STREAM, write it back after \"echo: \", close STREAM."
  (ignore-errors
   (let ((line (loop for b = (read-byte stream nil nil)
                     until (or (null b) (= b 10))
                     collect b)))
     (write-sequence (coerce (list* 101 99 104 111 58 32 line) '(vector (unsigned-byte 8)))
                     stream)
     (finish-output stream)
     (close stream))))

(hunchentoot:define-easy-handler (handle-detach-echo :uri "/detach-echo") ()
  ;; As a WebSocket-style handler: answer, keep the socket, then read what
  ;; the client sends next (a line) and write it back.
  (wait-for-client-octets gallop::*connection*)
  (setf (hunchentoot:content-type*) "text/plain")
  (let ((stream (hunchentoot:send-headers)))
    (hunchentoot:detach-socket hunchentoot:*acceptor*)
    (sb-thread:make-thread (lambda () (echo-a-line stream)) :name "detached echo"))
  nil)

(hunchentoot:define-easy-handler (handle-detach-echo-first :uri "/detach-echo-first") ()
  ;; As /detach-echo, but the handler returns only once its thread has
  ;; echoed and closed the stream: the close comes before the worker is
  ;; done with the connection, every time.
  (setf (hunchentoot:content-type*) "text/plain")
  (let ((stream (hunchentoot:send-headers))
        (closed (sb-thread:make-semaphore)))
    (hunchentoot:detach-socket hunchentoot:*acceptor*)
    (sb-thread:make-thread (lambda ()
                             (unwind-protect (echo-a-line stream)
                               (sb-thread:signal-semaphore closed)))
                           :name "detached echo")
    (sb-thread:wait-on-semaphore closed :timeout 10))
  nil)

(hunchentoot:define-easy-handler (handle-detach-echo-here :uri "/detach-echo-here") ()
  ;; Detach, then echo and close in the handler itself, before it returns.
  (setf (hunchentoot:content-type*) "text/plain")
  (let ((stream (hunchentoot:send-headers)))
    (hunchentoot:detach-socket hunchentoot:*acceptor*)
    (echo-a-line stream))
  nil)

(defparameter *detach-flood*
  (let ((octets (make-array (* 64 1024) :element-type '(unsigned-byte 8))))
    (dotimes (i (length octets) octets)
      (setf (aref octets i) (mod i 251))))
  "What the thread of /detach-flood writes: no two octets in a row alike, so
that a piece repeated, dropped or moved shows.")

(hunchentoot:define-easy-handler (handle-detach-flood :uri "/detach-flood") ()
  ;; The head SEND-HEADERS writes is only buffered when the handler
  ;; detaches; the thread it gives the stream to writes *DETACH-FLOOD* in
  ;; small pieces through the stream's buffer (for a few milliseconds),
  ;; then closes, while the handler returns (once the thread runs) and its
  ;; worker ends the request.
  (setf (hunchentoot:content-type*) "application/octet-stream")
  (let ((stream (hunchentoot:send-headers))
        (started (sb-thread:make-semaphore)))
    (hunchentoot:detach-socket hunchentoot:*acceptor*)
    (sb-thread:make-thread
     (lambda ()
       (sb-thread:signal-semaphore started)
       (ignore-errors
        (loop with octets = *detach-flood*
              for start from 0 below (length octets) by 8
              do (write-sequence octets stream :start start :end (+ start 8)))
        (finish-output stream))
       (ignore-errors (close stream)))
     :name "detached flood")
    (sb-thread:wait-on-semaphore started :timeout 10))
  nil)

(hunchentoot:define-easy-handler (handle-switch-echo :uri "/switch-echo") ()
  ;; As a WebSocket library on Hunchentoot does (hunchensocket): a 101, then
  ;; the new protocol on the same stream, in the handler's thread: a line
  ;; echoed.  (On an acceptor without output chunking: a 101 has no body.)
  (wait-for-client-octets gallop::*connection*)
  (setf (hunchentoot:return-code*) 101
        (hunchentoot:header-out :upgrade) "echo"
        (hunchentoot:header-out :connection) "Upgrade"
        (hunchentoot:content-type*) nil)
  (let ((stream (hunchentoot:send-headers)))
    (finish-output stream)
    (echo-a-line stream))
  nil)

(defun bottomless (n)
  "Recurses until the control stack is exhausted."
  (1+ (bottomless (1+ n))))

(hunchentoot:define-easy-handler (handle-deep :uri "/deep") ()
  (setf (hunchentoot:content-type*) "text/plain")
  (princ-to-string (bottomless 0)))
