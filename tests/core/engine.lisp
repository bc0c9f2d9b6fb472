;;;; engine.lisp -- GALLOP.CORE's engine with a minimal handler: limits,
;;;; timeouts and parking, as a raw-socket client sees them.
;;;;
;;;; Internals of GALLOP.CORE reached on purpose: the engine's connection
;;;; table, tallies and wheel, the buffer pool, the pool's groups and timers,
;;;; the pre-encoded error answers (engine.lisp, os/buffers.lisp,
;;;; pool/pool.lisp, timers/): that limits, timeouts and parking leave no
;;;; state behind, which a client cannot see.

(in-package #:gallop-tests)

(def-suite core :in gallop :description "The core engine, without Hunchentoot.")
(in-suite core)

(defun answer-request-lines (connection &optional before-answer)
  "Answer every request on CONNECTION with 200 and its request line as the
body; BEFORE-ANSWER, if given, is called with the request line first.
:KEEP-ALIVE once a read after the boundary answers end of file."
  (loop
    (let ((first-line nil) (line '()))
      (loop
        (let ((byte (read-byte connection nil nil)))
          (cond ((null byte) (close connection) (return-from answer-request-lines :keep-alive))
                ((= byte 10)
                 (when (null line) (return))
                 (unless first-line (setf first-line (coerce (nreverse line) 'string)))
                 (setf line '()))
                ((= byte 13))
                (t (push (code-char byte) line)))))
      (when before-answer
        (funcall before-answer first-line))
      (let ((body first-line))
        (write-sequence (octets (format nil "HTTP/1.1 200 OK~C~CContent-Length: ~D~C~C~C~C~A"
                                        #\Return #\Linefeed (length body)
                                        #\Return #\Linefeed #\Return #\Linefeed body))
                        connection)
        (finish-output connection)
        (gallop.core:connection-mark-boundary connection)))))

(defun hello-handler (connection)
  "Answer every request on CONNECTION with 200 and the request line."
  (answer-request-lines connection))

(defmacro with-engine ((engine port &rest options) &body body)
  (let ((socket (gensym "SOCKET")))
    `(let* ((,socket (make-instance 'sb-bsd-sockets:inet-socket :type :stream :protocol :tcp))
            (,engine (gallop.core:make-engine ,@options ; first: they may name the handler
                                              :handler #'hello-handler
                                              :log-error (lambda (&rest args) (declare (ignore args))))))
       (setf (sb-bsd-sockets:sockopt-reuse-address ,socket) t)
       (sb-bsd-sockets:socket-bind ,socket #(127 0 0 1) 0)
       (sb-bsd-sockets:socket-listen ,socket 128)
       (gallop.core:engine-start ,engine :listen-fd (sb-bsd-sockets:socket-file-descriptor ,socket))
       (unwind-protect
            (let ((,port (nth-value 1 (sb-bsd-sockets:socket-name ,socket))))
              ,@body)
         (gallop.core:engine-stop ,engine)
         (sb-bsd-sockets:socket-close ,socket)))))

(defun engine-stat (engine key) (getf (gallop.core:engine-stats engine) key))

(test engine-serves-and-parks-keep-alive-connections
  (with-engine (engine port :standby-thread-count 2)
    (let ((sockets (loop repeat 50 collect (connect port))))
      (unwind-protect
           (progn
             (dolist (socket sockets)
               (send socket (crlf "GET /a HTTP/1.1" "Host: x"))
               (is (string= "GET /a HTTP/1.1" (body-string (read-response socket)))))
             ;; 50 idle keep-alive connections wait parked in epoll.
             (is (wait-until (lambda () (= 50 (engine-stat engine :idle)))))
             (dolist (socket sockets)
               (send socket (crlf "GET /b HTTP/1.1" "Host: x"))
               (is (string= "GET /b HTTP/1.1" (body-string (read-response socket))))))
        (mapc #'usocket:socket-close sockets)))))

(defun returning-handler (outcome)
  "A handler that answers one request \"ok\" and returns OUTCOME."
  (lambda (connection)
    (loop with previous = nil
          for byte = (read-byte connection)
          until (and (eql byte 10) (eql previous 10))
          unless (eql byte 13) do (setf previous byte))
    (write-sequence (octets (concatenate 'string (crlf "HTTP/1.1 200 OK" "Content-Length: 2") "ok"))
                    connection)
    (finish-output connection)
    (gallop.core:connection-mark-boundary connection)
    outcome))

(defun answer-to-eof (port)
  "What the server on PORT sends, as a string, to one GET until it closes."
  (let ((socket (connect port)))
    (unwind-protect
         (progn (send socket (crlf "GET / HTTP/1.1" "Host: x"))
                (map 'string #'code-char (read-to-eof (usocket:socket-stream socket))))
      (usocket:socket-close socket))))

(test the-handler-says-what-becomes-of-the-connection
  "The value the handler returns decides: :KEEP-ALIVE serves the next request
on the same connection, :CLOSE closes it after the answer, and anything else
is logged and closes it too."
  (let ((answer (concatenate 'string (crlf "HTTP/1.1 200 OK" "Content-Length: 2") "ok")))
    (with-engine (engine port :handler (returning-handler :keep-alive))
      (let ((socket (connect port)))
        (unwind-protect
             (dotimes (i 2)
               (send socket (crlf "GET / HTTP/1.1" "Host: x"))
               (is (string= "ok" (body-string (read-response socket)))))
          (usocket:socket-close socket))))
    (with-engine (engine port :handler (returning-handler :close))
      (is (string= answer (answer-to-eof port))))
    (let ((logged '()))
      (with-engine (engine port :handler (returning-handler 42)
                                :log-error (lambda (control &rest args)
                                             (push (apply #'format nil control args) logged)))
        (is (string= answer (answer-to-eof port))))
      (is (= 1 (length logged)))
      (is (search "returned 42, not :KEEP-ALIVE" (first logged)) "~S" logged))))

(test request-line-too-long-gets-414
  (with-engine (engine port :max-request-line-bytes 1000 :max-head-bytes 4000)
    (let ((response (request port (format nil "GET /~A" (make-string 3000 :initial-element #\a)))))
      (is (= 414 (response-status response))))
    (is (= 1 (engine-stat engine :rejected)))))

(test methods-the-handler-does-not-serve-get-501
  "An engine told which methods its handler serves (:METHODS, as the
Hunchentoot front ends on Hunchentoot 1.3.x) answers any other with the
engine's own 501, exactly, and closes; exact case: \"get\" is not GET.  A
request before it on the same connection is served."
  (with-engine (engine port :methods '(:get :post))
    (dolist (line '("BREW /pot HTTP/1.1" "get / HTTP/1.1" "PROPFIND /d HTTP/1.1"))
      (let ((socket (connect port)))
        (unwind-protect
             (progn
               (send socket (concatenate 'string (crlf "GET /first HTTP/1.1" "Host: x")
                                         (crlf line "Host: x")))
               (let ((r (read-wire socket :persistent t)))
                 (is (= 200 (wire-status r)))
                 (is (string= "GET /first HTTP/1.1" (wire-body-string r))))
               (let ((r (read-wire socket :close t)))
                 (is (= 501 (wire-status r)) "~A: ~D" line (wire-status r))
                 (is (equalp "close" (wire-header r "Connection")))
                 (is (equalp (gallop.core::make-error-response 501)
                             (concatenate '(vector (unsigned-byte 8)) (wire-head r) (wire-body r)))
                     "~A: the 501 is not the engine's own answer" line)))
          (usocket:socket-close socket))))
    (is (= 200 (response-status (get-request port "/")))))
  (with-engine (engine port)
    ;; Without :METHODS, any method token is served.
    (let ((response (request port (crlf "BREW /pot HTTP/1.1" "Host: x"))))
      (is (= 200 (response-status response)))
      (is (string= "BREW /pot HTTP/1.1" (body-string response))))))

(test request-head-too-large-gets-431
  (with-engine (engine port :max-head-bytes 4000)
    (let ((response (request port (format nil "GET / HTTP/1.1~C~C~{X-Filler: ~A~C~C~}"
                                           #\Return #\Linefeed
                                           (loop repeat 100
                                                 append (list (make-string 60 :initial-element #\b)
                                                              #\Return #\Linefeed))))))
      (is (= 431 (response-status response))))))

(defun half-a-head-gets-408 (port)
  "Send half a request head to PORT and check that the answer, after the
header timeout, is a 408 with Connection: close, and that the server closes."
  (let ((socket (connect port)))
    (unwind-protect
         (progn
           (send socket "GET / HTTP/1.1")
           (let ((response (read-response socket)))
             (is (= 408 (response-status response)))
             (is (equalp "close" (header response "Connection"))))
           (is (closed-by-peer-p socket)))
      (usocket:socket-close socket))))

(test incomplete-head-times-out-with-408
  (with-engine (engine port :header-timeout 1)
    (half-a-head-gets-408 port)
    (is (= 1 (engine-stat engine :timeouts)))
    ;; still serving
    (is (= 200 (response-status (get-request port "/"))))))

(test the-housekeeper-rests-while-no-connection-is-open
  "With no connection open the housekeeper ticks once a second, not ten times
\(wheel.lisp, RESTING); a connection that then sends half a head still gets
its 408 after the header timeout.  (How rarely it switches while resting:
`make test-stress`.)"
  (with-engine (engine port :header-timeout 1)
    (is (= 200 (response-status (get-request port "/"))))
    (let ((wheel (gallop.core::engine-wheel engine)))
      (is-true (wait-until (lambda () (gallop.core::wheel-resting wheel)) :timeout 10)
               "the housekeeper never rested")
      (half-a-head-gets-408 port)
      (is (= 1 (engine-stat engine :timeouts)))
      (is-true (wait-until (lambda () (gallop.core::wheel-resting wheel)) :timeout 10)
               "the housekeeper did not rest again"))))

(test idle-keep-alive-connection-is-closed-after-the-idle-timeout
  (with-engine (engine port :idle-timeout 1)
    (let ((socket (connect port)))
      (unwind-protect
           (progn
             (send socket (crlf "GET / HTTP/1.1" "Host: x"))
             (is (= 200 (response-status (read-response socket))))
             (is (closed-by-peer-p socket :timeout 5)))
        (usocket:socket-close socket)))
    (is (wait-until (lambda () (zerop (engine-stat engine :open)))))))

(test pipelined-requests-in-one-packet-are-answered-in-order
  (with-engine (engine port)
    (let ((socket (connect port)))
      (unwind-protect
           (progn
             (send socket (format nil "~{~A~}" (loop for i below 10
                                                     collect (crlf (format nil "GET /~D HTTP/1.1" i)
                                                                   "Host: x"))))
             (dotimes (i 10)
               (is (string= (format nil "GET /~D HTTP/1.1" i)
                            (body-string (read-response socket))))))
        (usocket:socket-close socket)))))

;;; The kernel's names of the engine's threads (/proc/self/task/TID/comm):
;;; what top -H, ps -L and perf show.  SBCL leaves every thread "sbcl".

(defun os-thread-names ()
  "The kernel's name of each thread of this process."
  (loop for task in (directory "/proc/self/task/*/")
        for name = (ignore-errors
                    (with-open-file (in (merge-pathnames "comm" task)) (read-line in nil)))
        when name collect name))

(test engine-threads-have-kernel-names
  (with-engine (engine port :standby-thread-count 2)
    (let ((socket (connect port)))
      (unwind-protect
           (progn (send socket (crlf "GET /named HTTP/1.1" "Host: x"))
                  (is (string= "GET /named HTTP/1.1" (body-string (read-response socket)))))
        (usocket:socket-close socket)))
    ;; A thread names itself when it first runs, which on a busy machine
    ;; may come after a request was served: wait for every name.
    (let ((names (or (wait-until (lambda ()
                                   (let ((names (os-thread-names)))
                                     (and (member "gallop maker" names :test #'string=)
                                          (member "gallop keeper" names :test #'string=)
                                          (<= 2 (count "gallop worker" names :test #'string=))
                                          names))))
                     (os-thread-names))))
      (is (= 1 (count "gallop maker" names :test #'string=)) "~S" names)
      (is (= 1 (count "gallop keeper" names :test #'string=)) "~S" names)
      (is (<= 2 (count "gallop worker" names :test #'string=)) "~S" names)))
  ;; and once the engine stopped, none of them is left
  (is (wait-until (lambda ()
                    (notany (lambda (name) (search "gallop " name)) (os-thread-names))))
      "~S" (os-thread-names)))

(test engine-structures-print-as-one-short-line
  ;; They are arguments in the frames of every backtrace of a handler's
  ;; error: printed in full, an engine is its whole connection table.
  (with-engine (engine port :standby-thread-count 2)
    (let ((socket (connect port)))
      (unwind-protect
           (progn
             (send socket (crlf "GET /a HTTP/1.1" "Host: x"))
             (read-response socket)
             (let* ((pool (gallop.core:engine-pool engine))
                    (connection (find-if #'identity (gallop.core::engine-table engine)))
                    (objects (list engine pool
                                   (svref (gallop.core::pool-groups pool) 0)
                                   (first (gallop.core::pool-workers pool))
                                   (gallop.core::pool-timers pool)
                                   (gallop.core::engine-wheel engine)
                                   (svref (gallop.core::engine-tallies engine) 0)
                                   gallop.core::*buffer-pool*
                                   connection
                                   (gallop.core:connection-request connection)
                                   (gallop.core::make-chunk-decoder)
                                   (gallop.core::make-idle-meter)
                                   (gallop.core::make-load-history 0 0))))
               (is (notany #'null objects))
               (dolist (object objects)
                 (let ((text (let ((*print-circle* nil) (*print-length* nil) (*print-level* nil))
                               (prin1-to-string object))))
                   (is (and (<= (length text) 100) (string= "#<" text :end2 2))
                       "~A prints as ~D characters: ~A" (type-of object) (length text)
                       (subseq text 0 (min 200 (length text))))))))
        (usocket:socket-close socket)))))
