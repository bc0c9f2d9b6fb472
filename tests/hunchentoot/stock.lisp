;;;; stock.lisp -- loading Gallop leaves a stock acceptor stock: a
;;;; HUNCHENTOOT:EASY-ACCEPTOR with Hunchentoot's own taskmaster, in a
;;;; process where a GALLOP:EASY-ACCEPTOR serves too, answers every request
;;;; with the octets it answers in a process without Gallop (the Date
;;;; header's value aside).  Both are bench/server.lisp's stock server, in
;;;; child processes loading the Hunchentoot this image loaded.

(in-package #:gallop-tests)

(in-suite taskmaster)

(defun start-stock-child (port &key beside)
  "bench/server.lisp's stock server on PORT in a child process, with a
GALLOP:EASY-ACCEPTOR on BESIDE too when given, and no other BENCH_
setting of this process's.  The process, once READY (within 120 s); its
standard error goes to /tmp/gallop-stock-PORT.err."
  (let* ((hunchentoot (asdf:system-source-directory "hunchentoot"))
         (process (sb-ext:run-program
                   "scripts/lisp.sh"
                   (list "--eval" (format nil "(push ~S asdf:*central-registry*)"
                                          (namestring hunchentoot))
                         "--load" "bench/server.lisp"
                         "--end-toplevel-options" "stock" (princ-to-string port) "0")
                   :environment (append (and beside (list (format nil "BENCH_BESIDE_GALLOP=~D" beside)))
                                        (remove-if (lambda (v) (eql 0 (search "BENCH_" v)))
                                                   (sb-ext:posix-environ)))
                   :wait nil :input :stream :output :stream
                   :error (format nil "/tmp/gallop-stock-~D.err" port) :if-error-exists :supersede
                   :directory (asdf:system-source-directory "gallop"))))
    (let ((line (handler-case (sb-sys:with-deadline (:seconds 120)
                                (read-line (sb-ext:process-output process) nil ""))
                  (sb-sys:deadline-timeout () "(no READY in 120 s)"))))
      (unless (eql 0 (search "READY" line))
        (ignore-errors (sb-ext:process-kill process 9))
        (sb-ext:process-wait process)
        (sb-ext:process-close process)
        (error "The stock child on port ~D did not start: ~S (see /tmp/gallop-stock-~D.err)"
               port line port)))
    process))

(defun stop-stock-child (process)
  (ignore-errors (write-line "quit" (sb-ext:process-input process))
                 (finish-output (sb-ext:process-input process)))
  (unless (handler-case (sb-sys:with-deadline (:seconds 30) (sb-ext:process-wait process) t)
            (sb-sys:deadline-timeout () nil))
    (ignore-errors (sb-ext:process-kill process 9))
    (sb-ext:process-wait process))
  (sb-ext:process-close process))

(defparameter *stock-requests*
  (list (crlf "GET /yo HTTP/1.1" "Host: x" "Connection: close")
        (crlf "GET /yo?name=Ann HTTP/1.1" "Host: x" "Connection: close")
        (crlf "HEAD /yo HTTP/1.1" "Host: x" "Connection: close")
        (crlf "GET /nowhere HTTP/1.1" "Host: x" "Connection: close")
        (crlf "GET /yo HTTP/1.0")
        (concatenate 'string (crlf "GET /yo?name=1 HTTP/1.1" "Host: x")
                     (crlf "GET /yo?name=2 HTTP/1.1" "Host: x")
                     (crlf "GET /yo?name=3 HTTP/1.1" "Host: x" "Connection: close"))
        (concatenate 'string (crlf "POST /upload HTTP/1.1" "Host: x" "Content-Length: 11"
                                   "Connection: close")
                     "hello world")
        (crlf "GET /error HTTP/1.1" "Host: x" "Connection: close")
        (crlf "GET /big HTTP/1.1" "Host: x" "Connection: close")
        (crlf "GET /stream HTTP/1.1" "Host: x" "Connection: close")
        (crlf "GET /yo HTTP/1.1" "Host: x" "Accept-Encoding: gzip" "Cookie: a=b"
              "Connection: close"))
  "What each stock server is sent, one connection each, read to its end.
\(Not a chunked upload: stock Hunchentoot 1.2.38 never answers /upload's.)")

(defun without-dates (octets port)
  "OCTETS as a string, each Date header's value left out and PORT (which
Hunchentoot's error pages name) written PORT."
  (let ((text (map 'string #'code-char octets)))
    (loop for at = (search (princ-to-string port) text)
          while at
          do (setf text (concatenate 'string (subseq text 0 at) "PORT"
                                     (subseq text (+ at (length (princ-to-string port)))))))
    (with-output-to-string (out)
      (loop with start = 0
            for at = (search (format nil "~C~CDate: " #\Return #\Linefeed) text :start2 start)
            do (write-string text out :start start :end (or at (length text)))
               (unless at (return))
               (let ((end (search (format nil "~C~C" #\Return #\Linefeed) text :start2 (+ at 2))))
                 (write-string (format nil "~C~CDate: -" #\Return #\Linefeed) out)
                 (setf start end))))))

(defun stock-answer (port request)
  (let ((socket (connect port)))
    (unwind-protect
         (progn (send socket request)
                (read-to-eof (usocket:socket-stream socket)))
      (usocket:socket-close socket))))

(defun distinct-free-ports (n)
  "N distinct ports no socket listens on now, all held open while the
kernel picks them, so that it cannot hand out one twice."
  (let ((sockets (loop repeat n
                       collect (usocket:socket-listen "127.0.0.1" 0 :reuse-address t))))
    (prog1 (mapcar #'usocket:get-local-port sockets)
      (mapc #'usocket:socket-close sockets))))

(test a-stock-acceptor-answers-as-without-gallop
  "A stock easy-acceptor beside a running GALLOP:EASY-ACCEPTOR answers each
request with the octets of one in a process without Gallop."
  (destructuring-bind (alone-port stock-port gallop-port) (distinct-free-ports 3)
    (let* ((alone (start-stock-child alone-port))
           (beside (ignore-errors (start-stock-child stock-port :beside gallop-port))))
      (unwind-protect
           (progn
             (is (not (null beside)) "the child with Gallop started")
             (let ((served (stock-answer alone-port (first *stock-requests*))))
               (is (search "Hey!" (map 'string #'code-char served))
                   "the stock server alone serves: ~S" (map 'string #'code-char served)))
             (when beside
               (let ((served (stock-answer gallop-port (first *stock-requests*))))
                 (is (search "Hey!" (map 'string #'code-char served))
                     "Gallop serves beside: ~S" (map 'string #'code-char served)))
               (dolist (request *stock-requests*)
                 (let ((expected (without-dates (stock-answer alone-port request) alone-port))
                       (got (without-dates (stock-answer stock-port request) stock-port)))
                   (is (plusp (length expected)))
                   (is (string= expected got)
                       "~S: without Gallop ~D octets, beside it ~D, first difference at ~S"
                       (subseq request 0 (position #\Return request))
                       (length expected) (length got) (mismatch expected got))))))
        (stop-stock-child alone)
        (when beside (stop-stock-child beside))))))

;;; Gallop's methods on the libraries' generic functions

(defun gallop-definition-p (method)
  "True if METHOD was defined in Gallop's source tree."
  (let* ((source (ignore-errors (sb-introspect:find-definition-source method)))
         (file (and source (sb-introspect:definition-source-pathname source))))
    (and file
         (eql 0 (search (namestring (asdf:system-source-directory "gallop"))
                        (namestring (or (probe-file file) file)))))))

(defun stock-classes ()
  "Every class an object of a stock Hunchentoot server is an instance of:
the class precedence lists of its acceptors, taskmasters, request and reply."
  (remove-duplicates
   (loop for name in '(hunchentoot:easy-acceptor hunchentoot:easy-ssl-acceptor
                       hunchentoot:one-thread-per-connection-taskmaster
                       hunchentoot:single-threaded-taskmaster
                       hunchentoot:request hunchentoot:reply)
         for class = (find-class name)
         do (sb-mop:finalize-inheritance class)
         append (sb-mop:class-precedence-list class))))

(defun methods-on-stock-classes ()
  "Gallop's methods, on the generic functions of Hunchentoot and the
libraries it serves through, that a stock server's objects could select:
each of their specializers is one of STOCK-CLASSES."
  (let ((stock (stock-classes))
        (found '()))
    (dolist (package '("HUNCHENTOOT" "USOCKET" "CHUNGA" "FLEXI-STREAMS" "CL+SSL"
                       "SB-GRAY" "COMMON-LISP"))
      (do-symbols (symbol package)
        (when (and (eq (symbol-package symbol) (find-package package))
                   (fboundp symbol)
                   (typep (fdefinition symbol) 'generic-function))
          (dolist (method (sb-mop:generic-function-methods (fdefinition symbol)))
            (when (and (every (lambda (s) (member s stock)) (sb-mop:method-specializers method))
                       (gallop-definition-p method))
              (pushnew method found))))))
    found))

(test gallop-methods-are-on-gallop-classes
  "No method of Gallop's on Hunchentoot's (or usocket's, chunga's, cl+ssl's,
the Gray streams') generic functions applies to a stock server's acceptor,
taskmaster, request or reply: a stock acceptor runs Hunchentoot's methods."
  (let ((found (methods-on-stock-classes)))
    (is (null found) "Gallop's methods on stock classes: ~S" found)
    ;; The check sees where a method was defined: Gallop's DETACH-SOCKET
    ;; :AFTER is Gallop's.
    (is (some #'gallop-definition-p
              (sb-mop:generic-function-methods #'hunchentoot:detach-socket)))))

(test a-stock-acceptor-with-gallop-taskmaster-is-served
  "A stock acceptor started with a GALLOP:TASKMASTER becomes a served
acceptor, still of its own class; other stock acceptors stay stock."
  (let ((tm (make-instance 'gallop:taskmaster)))
    (with-server (server 'hunchentoot:easy-acceptor :taskmaster tm)
      (is (typep server 'gallop::served-acceptor))
      (is (typep server 'hunchentoot:easy-acceptor))
      (is (not (typep server 'gallop:acceptor)))
      (is (string= "Hey!" (body-string (get-request (port-of server) "/yo" "Connection: close")))))
    (is (typep tm 'gallop:taskmaster))
    (let ((plain (make-instance 'hunchentoot:easy-acceptor :port 0)))
      (is (eq (find-class 'hunchentoot:easy-acceptor) (class-of plain))
          "a new stock acceptor is of the stock class"))))

(defclass trailing-mixin () ()
  (:documentation "A mixin listed after an acceptor class."))
(defclass stock-with-mixin (hunchentoot:easy-acceptor trailing-mixin) ())
(defclass gallop-with-mixin (gallop:easy-acceptor trailing-mixin) ())

(test served-acceptor-comes-right-after-hunchentoot-acceptor
  "On a served stock class as on a Gallop one, SERVED-ACCEPTOR follows
HUNCHENTOOT:ACCEPTOR at once, before a mixin listed after the acceptor
class; the served class has a name FIND-CLASS knows."
  (let ((served (gallop::served-class (find-class 'stock-with-mixin))))
    (is (eq served (gallop::served-class (find-class 'stock-with-mixin))) "made once")
    (is (eq served (find-class (class-name served))))
    (dolist (class (list* served (find-class 'gallop-with-mixin)
                          (mapcar #'find-class '(gallop:acceptor gallop:easy-acceptor
                                                 gallop:ssl-acceptor gallop:easy-ssl-acceptor))))
      (sb-mop:finalize-inheritance class)
      (let* ((cpl (sb-mop:class-precedence-list class))
             (acceptor (position (find-class 'hunchentoot:acceptor) cpl))
             (mixin (position (find-class 'trailing-mixin) cpl))
             (gallop (position (find-class 'gallop::served-acceptor) cpl)))
        (is (eql gallop (1+ acceptor)) "~S: ~S" class cpl)
        (is-true (if mixin (< gallop mixin) t) "~S: ~S" class cpl)))))

;;; Gallop's request loop takes the place of Hunchentoot's method, not of the
;;; user's: their primary method (calling the next) and :BEFORE still run,
;;; once for each run of the loop, and the connection is still kept, in
;;; whatever order the user's class lists a Gallop class and theirs.

(sb-ext:define-load-time-global *loop-notes* '())

(defclass noted-loop-acceptor (hunchentoot:acceptor) ()
  (:documentation "A library's acceptor with methods of its own on PROCESS-CONNECTION."))

(defmethod hunchentoot:process-connection :before ((acceptor noted-loop-acceptor) socket)
  (declare (ignore socket))
  (sb-ext:atomic-push :before *loop-notes*))

(defmethod hunchentoot:process-connection ((acceptor noted-loop-acceptor) socket)
  (declare (ignore socket))
  (sb-ext:atomic-push :primary *loop-notes*)
  (call-next-method))

(defclass noted-stock-acceptor (hunchentoot:easy-acceptor noted-loop-acceptor) ())
(defclass noted-after-gallop-acceptor (gallop:easy-acceptor noted-loop-acceptor) ())
(defclass noted-before-gallop-acceptor (noted-loop-acceptor gallop:easy-acceptor) ())

(test the-users-process-connection-methods-run-around-gallops-loop
  (dolist (setup (list (list 'noted-stock-acceptor :taskmaster (make-instance 'gallop:taskmaster))
                       (list 'noted-after-gallop-acceptor)
                       (list 'noted-before-gallop-acceptor)))
    (setf *loop-notes* '())
    (let ((server (apply #'make-server setup)))
      (hunchentoot:start server)
      (unwind-protect
           (let ((socket (connect (port-of server))))
             (unwind-protect
                  (dotimes (i 2)
                    (send socket (crlf "GET /yo HTTP/1.1" "Host: x"))
                    (let ((response (read-response socket)))
                      (is (eql 200 (and response (response-status response)))
                          "~S, request ~D" (first setup) i)
                      (is (string= "Hey!" (if response (body-string response) "")))
                      (is (null (and response (header response "Connection")))))
                    ;; The worker lets go of the kept connection, which
                    ;; waits in epoll: the next request is another run.
                    (is (wait-until (lambda () (eql 1 (stat server :idle))))
                        "~S: not idle: ~S" (first setup) (gallop:stats server)))
               (usocket:socket-close socket)))
        (hunchentoot:stop server)))
    (is (equal '(:primary :before :primary :before) *loop-notes*)
        "~S: ~S" (first setup) *loop-notes*)))
